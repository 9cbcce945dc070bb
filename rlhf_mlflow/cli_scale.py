"""`rlhf-mlflow sweep` and `rlhf-mlflow server`: scaling out to Ray Tune and a shared tracking server.
cli.py registers COMMANDS on the `rlhf-mlflow` group."""
from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict

import click

from .cli import _rl_config, _rl_options, _world_dir
from .errors import InputError
from .files import atomic_write_text, check_writable

TABLE_COLUMNS = ["trial", "status", "rank", "certified/balanced", "certified_lo/balanced", "certified_hi/balanced",
                 "gain/balanced", "dev_proxy/balanced", "dev_kl/balanced", "model_version"]


@click.command("sweep")
@click.option("--world", default=None, help="World directory (default: the default world, built on first use).")
@click.option("--config", "config_path", default=None, help="JSON base recipe (default: <world>/configs/default.json).")
@click.option("--override", "overrides", multiple=True, help="key=value on the base recipe, repeatable.")
@_rl_options
@click.option("--grid", "grid", multiple=True,
              help="key=v1,v2,... (repeatable; or several joined by ';'): one trial per combination.")
@click.option("--ray-address", default="", help="Ray cluster to run on (default: RAY_ADDRESS, else a local Ray).")
@click.option("--max-concurrent", type=int, default=0, show_default=True,
              help="Trials at once (0: as many as the CPUs allow).")
@click.option("--trial-threads", type=int, default=1, show_default=True, help="CPUs and torch threads per trial.")
@click.option("--name", "sweep_name", default="sweep", show_default=True, help="Parent run name.")
@click.option("--diagnostic", "diagnostic_path", default=None,
              help="Diagnostic evidence JSON for the marker-collapse guardrail (default: run the diagnostic once).")
@click.option("--guardrail", "guardrail_overrides", multiple=True, help="key=value guardrail threshold, repeatable.")
@click.option("--release/--no-release", "do_release", default=False, show_default=True,
              help="Hand the best trial's model version to release.")
@click.option("--out", default=None, help="Also write the trial table here (CSV).")
@click.pass_context
def sweep_cmd(ctx, world, config_path, overrides, grid, ray_address, max_concurrent, trial_threads, sweep_name,
              diagnostic_path, guardrail_overrides, do_release, out, **options):
    """A recipe grid as Ray Tune trials; each trial trains, evaluates, certifies and checks guardrails."""
    import functools

    from .config import parse_override
    from .rl_config_io import fixture_root
    from .sweep import SweepConfig, best_trial, expand_grid, parse_grid, rank_trials, run_sweep
    from .tracking import sweep_runs as S
    if out:
        check_writable(out)
    world_dir = _world_dir(world) if not config_path else (world or fixture_root(config_path))
    base = _rl_config(ctx, world_dir, config_path, overrides, options)
    recipes = _checked_recipes(base, expand_grid(parse_grid(grid)))
    guardrails = dict(parse_override(g) for g in guardrail_overrides)
    _check_guardrails(guardrails)
    scfg = SweepConfig(ray_address=ray_address or None, max_concurrent=max_concurrent, trial_threads=trial_threads,
                       name=sweep_name)
    uri = S.absolute_tracking_uri()
    if (scfg.ray_address or os.environ.get("RAY_ADDRESS")) and S.is_local_store(uri):
        raise click.ClickException(f"trials on a Ray cluster cannot write to the local store {uri}: start a shared "
                                   "server (`rlhf-mlflow server`) and set MLFLOW_TRACKING_URI to it")
    params = {"grid": parse_grid(grid), "trials": len(recipes), "world": os.path.abspath(world_dir),
              "ray_address": scfg.ray_address or os.environ.get("RAY_ADDRESS", "local"),
              "trial_threads": trial_threads, **{f"base.{k}": v for k, v in asdict(base).items()},
              **{f"guardrail.{k}": v for k, v in guardrails.items()}}
    with S.sweep_run(sweep_name, params) as (run, experiment):
        S.log_training_inputs({base.prompt_file} | {r["prompt_file"] for r in recipes if "prompt_file" in r})
        diagnostic = _diagnostic(world_dir, diagnostic_path)
        tctx = S.TrialContext(tracking_uri=uri, experiment_name=experiment, parent_run_id=run.info.run_id,
                              world_dir=os.path.abspath(world_dir), base=asdict(base), threads=trial_threads,
                              diagnostic=diagnostic, champion=S.current_champion(), guardrails=guardrails)
        click.echo(f"sweep {run.info.run_id}: {len(recipes)} trials on Ray", err=True)
        ranked = rank_trials(run_sweep(functools.partial(S.run_trial, tctx), recipes, scfg))
        best = best_trial(ranked)
        S.log_sweep_results(ranked, best)
        _echo_table(ranked)
        if out:
            atomic_write_text(out, ranked.to_csv(index=False))
        failed = ranked[ranked["status"] != "FINISHED"]
        if best is None:
            click.echo("best trial: none (no trial is certified with every guardrail passing)")
        else:
            click.echo(f"best trial: {best['trial']} (certified balanced {best['certified/balanced']:.3f}, "
                       f"rlhf-policy version {best['model_version']}, run {best['run_id']})")
            if do_release:
                hand_to_release(str(best["model_version"]), guardrails)
        if len(failed):
            raise click.ClickException(f"{len(failed)} of {len(ranked)} trials failed: {', '.join(failed['trial'])}")


def _echo_table(ranked) -> None:
    """The trial table (every guardrail a column), then why each trial failed or was not eligible."""
    import pandas as pd
    cols = [c for c in TABLE_COLUMNS if c in ranked] + [c for c in ranked if c.startswith("guardrail/")]
    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.max_colwidth", 60):
        click.echo(ranked[cols].to_string(index=False))
    for _, r in ranked.iterrows():
        why = r.get("error") or r.get("failed_guardrails")
        if isinstance(why, str) and why:
            click.echo(f"  {r['trial']}: {why}")


def _checked_recipes(base, recipes: list[dict]) -> list[dict]:
    """Paths in the grid made absolute; every trial's config validated before anything runs."""
    from .config import from_dict
    from .train_rl import PATH_KEYS, RLConfig
    out = []
    for recipe in recipes:
        r = {k: os.path.abspath(v) if k in PATH_KEYS and isinstance(v, str) else v for k, v in recipe.items()}
        from_dict(RLConfig, {**asdict(base), **r}, f"--grid {r}")
        out.append(r)
    return out


def _check_guardrails(overrides: dict) -> None:
    """Unknown keys or bad thresholds fail before any trial runs."""
    try:
        from .guardrails import GuardrailConfig
    except ImportError:
        return
    GuardrailConfig.from_dict(overrides, "--guardrail")


def _diagnostic(world_dir: str, path: str | None) -> dict | None:
    """The given evidence JSON, else the gold-free diagnostic run once on the world (logged on the parent)."""
    from .errors import read_json
    from .tracking import runs as T
    if path:
        return read_json(path)
    from .diagnostic import run_diagnostic
    result = run_diagnostic(os.path.join(world_dir, "reward_model"), os.path.join(world_dir, "policy"),
                            os.path.join(world_dir, "data", "prompts_train.jsonl"))
    T.log_json_artifact(result, "diagnostic.json")
    return result


def hand_to_release(version: str, guardrails: dict) -> None:
    """Release the sweep's best version with the sweep's guardrail thresholds: promoted to champion
    only if every guardrail passes (against the champion at release time)."""
    try:
        from .release_run import run_release
    except ImportError as e:
        raise click.ClickException(f"release is not available ({e})") from None
    run_release(version, guardrails=guardrails, echo=click.echo)


@click.command("server")
@click.option("--root", default="mlflow-server", show_default=True,
              help="Directory for the database, the artifacts and the logs (reused when it exists).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (0.0.0.0: every interface).")
@click.option("--port", type=int, default=5000, show_default=True, help="Tracking server port (0: any free port).")
@click.option("--backend", type=click.Choice(["postgresql", "sqlite"]), default="postgresql", show_default=True,
              help="Backend store: a PostgreSQL cluster under --root, or --root/mlflow.db.")
@click.option("--db-port", type=int, default=0, show_default=True, help="PostgreSQL port on 127.0.0.1 (0: any free).")
@click.option("--workers", type=int, default=1, show_default=True, help="Tracking server worker processes.")
def server_cmd(root, host, port, backend, db_port, workers):
    """A shared MLflow tracking server on PostgreSQL, until Ctrl-C."""
    from .server import ServerConfig, TrackingServer
    server = TrackingServer(ServerConfig(root=root, host=host, port=port, backend=backend, db_port=db_port,
                                         workers=workers))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        uri = server.start()
        click.echo(json.dumps({"tracking_uri": uri, "backend": backend, "root": os.path.abspath(root),
                               "log": server.logfile}, indent=1))
        click.echo(f"export MLFLOW_TRACKING_URI={uri}", err=True)
        code = server.wait()
        raise click.ClickException(f"mlflow server exited with code {code}:\n{server.log_tail()}")
    except KeyboardInterrupt:
        click.echo("stopping", err=True)
    except (RuntimeError, InputError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        server.stop()


COMMANDS = (sweep_cmd, server_cmd)
