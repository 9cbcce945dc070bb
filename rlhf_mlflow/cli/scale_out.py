"""`rlhf-mlflow sweep | server`: scaling out to Ray Tune and a shared tracking server."""
from __future__ import annotations

import os

import click

from rlhf_mlflow.cli.options import (
    check_rl_options,
    echo_err,
    echo_json,
    resolve_world,
    rl_config,
    rl_options,
    world_option,
)
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.files import atomic_write_text

TABLE_COLUMNS = ["trial", "status", "rank", "certified/balanced", "certified_lo/balanced", "certified_hi/balanced",
                 "gain/balanced", "dev_proxy/balanced", "dev_kl/balanced", "model_version"]


@click.command("sweep")
@world_option
@click.option("--config", "config_path", default=None, help="JSON base recipe (default: <world>/configs/default.json).")
@click.option("--override", "overrides", multiple=True, help="key=value on the base recipe, repeatable.")
@rl_options
@click.option("--grid", "grid", multiple=True,
              help="key=v1,v2,... (repeatable; or several joined by ';'): one trial per combination.")
@click.option("--ray-address", default="", help="Ray cluster to run on (default: RAY_ADDRESS, else a local Ray).")
@click.option("--max-concurrent", type=click.IntRange(0, 1024), default=0, show_default=True,
              help="Trials at once (0: as many as the CPUs allow).")
@click.option("--trial-threads", type=click.IntRange(1, 256), default=1, show_default=True,
              help="CPUs and torch threads per trial.")
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
    from rlhf_mlflow.core.config import parse_override
    from rlhf_mlflow.core.world_paths import WorldPaths
    from rlhf_mlflow.decisions.guardrails import GuardrailConfig
    from rlhf_mlflow.steps.outputs import check_out
    from rlhf_mlflow.steps.ray_tune import SweepConfig, parse_grid
    from rlhf_mlflow.steps.sweep import check_grid, release_best, run_sweep_step
    from rlhf_mlflow.training.batch_run import batch_runs
    from rlhf_mlflow.training.rl_config import fixture_root
    check_rl_options(ctx, overrides, options)  # before the default world is built or a run starts
    recipes = parse_grid(grid)
    check_grid(recipes)
    guardrails = dict(parse_override(g) for g in guardrail_overrides)
    GuardrailConfig.from_dict(guardrails, "--guardrail")
    if out:
        check_out(out, {"--config": config_path, "--diagnostic": diagnostic_path})
    paths = WorldPaths.at(world or fixture_root(config_path)) if config_path else resolve_world(world)
    base = rl_config(ctx, paths, config_path, overrides, options)
    scfg = SweepConfig(ray_address=ray_address or None, max_concurrent=max_concurrent, trial_threads=trial_threads,
                       name=sweep_name, batch=batch_runs())
    result = run_sweep_step(paths, base, recipes, guardrails, scfg, diagnostic_path, echo=echo_err)
    _echo_table(result.table)
    if out:
        atomic_write_text(out, result.table.to_csv(index=False))
    best = result.best
    if best is None:
        click.echo("best trial: none (no trial is certified with every guardrail passing)")
    else:
        click.echo(f"best trial: {best['trial']} (certified balanced {best['certified/balanced']:.3f}, "
                   f"rlhf-policy version {best['model_version']}, run {best['run_id']})")
        if do_release:
            release_best(result, guardrails, echo=click.echo)
    failed = result.table[result.table["status"] != "FINISHED"]
    if len(failed):
        raise InputError(f"{len(failed)} of {len(result.table)} trials failed: {', '.join(failed['trial'])}")


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


@click.command("server")
@click.option("--root", default="mlflow-server", show_default=True,
              help="Directory for the database, the artifacts and the logs (reused when it exists).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=5000, show_default=True,
              help="Tracking server port (0: any free port).")
@click.option("--backend", type=click.Choice(["postgresql", "sqlite"]), default="postgresql", show_default=True,
              help="Backend store: a PostgreSQL cluster under --root, or --root/mlflow.db.")
@click.option("--db-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="PostgreSQL port on 127.0.0.1 (0: any free).")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Tracking server worker processes.")
def server_cmd(root, host, port, backend, db_port, workers):
    """A shared MLflow tracking server on PostgreSQL, until Ctrl-C."""
    from rlhf_mlflow.tracking.server import ServerConfig, TrackingServer
    server = TrackingServer(ServerConfig(root=root, host=host, port=port, backend=backend, db_port=db_port,
                                         workers=workers))
    try:
        uri = server.start()
        echo_json({"tracking_uri": uri, "backend": backend, "root": os.path.abspath(root), "log": server.logfile})
        echo_err(f"export MLFLOW_TRACKING_URI={uri}")
        code = server.wait()
        raise click.ClickException(f"mlflow server exited with code {code}:\n{server.log_tail()}")
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (core/process.handle_signals)
        echo_err("stopping")
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    finally:
        server.stop()


COMMANDS = (sweep_cmd, server_cmd)
