"""`rlhf-mlflow`: one command per MLproject entry point."""
from __future__ import annotations

import json
import logging
import os
import sys

import click

from .errors import InputError
from .files import check_writable

DEFAULT_WORLDS = "worlds"


def _setup() -> None:
    from .runtime import configure_threads, handle_signals
    configure_threads()
    handle_signals()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


class Group(click.Group):
    """Turns InputError, and an OSError on a named file (a full disk, a vanished directory), into one
    clear error line (`Error: ...`, exit code 1; the step's run has already ended FAILED), and an
    interrupt (Ctrl-C, SIGTERM) into one line and exit code 130 (the run is already marked KILLED)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            if e.filename is None:
                raise
            raise click.ClickException(f"{e.filename}: {e.strerror or e}") from None
        except KeyboardInterrupt:
            click.echo("interrupted: the step's MLflow run is marked KILLED (a train-rl run continues with "
                       "`rlhf-mlflow train-rl --resume RUN_ID`)", err=True)
            ctx.exit(130)


@click.group(cls=Group)
def cli():
    """A small RLHF pipeline in pure PyTorch where every step is an MLflow run."""
    _setup()


@cli.command("build-world")
@click.option("--seed", type=int, default=0, show_default=True, help="World seed.")
@click.option("--spec", default="default", show_default=True,
              help="Corruption spec: 'default' (dune pa +1.45, ember he +0.47), 'clean', or a JSON file.")
@click.option("--scale", type=click.Choice(["full", "bench", "test"]), default="full", show_default=True,
              help="'test' builds a small world in seconds; 'bench' a mid-size one for benchmarks.")
@click.option("--out", default=None, help="Output directory (default: worlds/<hash>, reused when it exists).")
def build_world_cmd(seed, spec, scale, out):
    """Build (or reuse) a synthetic world with a hidden truth."""
    from . import data as D
    from .tracking import runs as T
    from .world import corruptions as C
    from .world.build import build_world, ensure_world
    if out:
        check_writable(out, directory=True)
    rules = C.load_spec(spec)
    with T.tracked_run("build_world", {"seed": seed, "spec": rules, "scale": scale}):
        if out:
            manifest = build_world(out, seed, rules, scale, progress=click.echo)
            path = out
        else:
            path, manifest = ensure_world(DEFAULT_WORLDS, seed, rules, scale, progress=click.echo)
        T.log_params({"world_hash": manifest["world_hash"], "world": os.path.abspath(path)})
        T.log_json_artifact({k: v for k, v in manifest.items()}, "manifest.json")
        T.log_metrics({f"timing/{k}": v for k, v in manifest["timings"].items()})
        for rel, context in (("data/prompts_train.jsonl", "train"), ("data/prompts_dev.jsonl", "dev"),
                             ("data/gold_calib.jsonl", "gold"), ("reward_model/train.jsonl", "qa")):
            records = D.read_jsonl(os.path.join(path, rel), labelled=context in ("gold", "qa"))
            T.log_records_input(records, os.path.join(path, rel), context)
    click.echo(json.dumps({"world": os.path.abspath(path), "world_hash": manifest["world_hash"],
                           "timings": manifest["timings"]}, indent=1))


def _world_dir(world: str | None) -> str:
    """The given world, or the default world (seed 0, default spec), built once on first use."""
    if world:
        if not os.path.isdir(world):
            raise InputError(f"{world}: no such world directory")
        return world
    from .world.build import ensure_world
    return ensure_world(DEFAULT_WORLDS, progress=click.echo)[0]


def _rl_options(fn):
    """One click option per RLConfig field, same name (dashes for underscores), type and default."""
    import dataclasses
    from .train_rl import RLConfig
    for f in reversed(dataclasses.fields(RLConfig)):
        default = "" if f.default is None else f.default
        if f.name == "family_weights":
            default, kind = "", str
        else:
            kind = type(default)
        fn = click.option(f"--{f.name.replace('_', '-')}", f.name, type=kind, default=default,
                          show_default=True, help=_FIELD_HELP[f.name])(fn)
    return fn


_FIELD_HELP = {
    "policy_init": "Start checkpoint (default: policy_ref).", "policy_ref": "Reference policy directory.",
    "reward_model": "Reward-model directory.", "prompt_file": "Prompt records JSONL.",
    "family_weights": 'JSON mapping family -> weight, e.g. \'{"dune": 0}\' (default: uniform).',
    "kl_coef": "beta in R - beta * KL.", "steps": "Optimiser steps.", "batch_prompts": "Prompts per step.",
    "samples_per_prompt": "Samples per prompt (>= 2).", "lr": "Adam learning rate.",
    "temperature": "Sampling temperature.", "seed": "Seed.", "log_every": "Metrics every N steps.",
    "save_every": "Checkpoint every N steps (0: final only).",
    "reward_wrapper": "Python file with transform(records, response_tokens, rewards).",
    "max_grad_norm": "Gradient-norm clip.",
}


def _rl_config(ctx, world_dir, config_path, overrides, options):
    """Precedence: explicit options > --override > config file > defaults. Relative paths in options
    resolve against the world directory (where the defaults point), in --override against the cwd."""
    from click.core import ParameterSource

    from .rl_config_io import load_rl_config
    from .train_rl import PATH_KEYS
    explicit = []
    for name, value in options.items():
        if ctx.get_parameter_source(name) == ParameterSource.DEFAULT:
            continue
        if name in ("family_weights", "reward_wrapper", "policy_init") and value == "":
            value = None
        elif name == "family_weights":
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InputError(f"--family-weights: not valid JSON ({e.msg}): {value!r}") from None
        elif name in PATH_KEYS and not os.path.isabs(value) and world_dir:
            value = os.path.join(world_dir, value)
        explicit.append(f"{name}={json.dumps(value)}")
    base = config_path or os.path.join(world_dir, "configs", "default.json")
    return load_rl_config(base, list(overrides) + explicit, root=None if config_path else world_dir)


@cli.command("train-rl")
@click.option("--world", default=None, help="World directory (default: the default world, built on first use).")
@click.option("--config", "config_path", default=None, help="JSON recipe (default: <world>/configs/default.json).")
@click.option("--override", "overrides", multiple=True, help="key=value, repeatable; value parsed as JSON.")
@_rl_options
@click.option("--out", default=None, help="Also write the checkpoint, run_config.json and log.jsonl here "
              "(an empty directory, or one this run's marker .rlhf_run.json claims).")
@click.option("--overwrite", type=click.BOOL, is_flag=False, flag_value=True, default=False, show_default=True,
              help="Delete what --out holds first (another run's files); `--overwrite` alone or "
              "`--overwrite true|false` (as `mlflow run -P overwrite=true` passes it).")
@click.option("--run-name", default=None, help="MLflow run name (default: kl<kl_coef>-s<steps>).")
@click.option("--register/--no-register", default=True, show_default=True,
              help="Register the final policy as a new version of rlhf-policy.")
@click.option("--resume", "resume_run", default=None, metavar="RUN_ID",
              help="Continue this train_rl run that died, from its last checkpoint, in the same MLflow run.")
@click.pass_context
def train_rl_cmd(ctx, world, config_path, overrides, out, overwrite, run_name, register, resume_run, **options):
    """KL-regularised REINFORCE against a reward model, as an MLflow run."""
    from click.core import ParameterSource

    from .files import check_run_dir
    from .rl_run import resume_train_rl, run_train_rl
    echo = lambda m: click.echo(m, err=True)  # noqa: E731
    if resume_run:
        given = [n for n in ("world", "config_path", "overrides", "run_name", "overwrite", *options)
                 if ctx.get_parameter_source(n) != ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"--resume continues the run with its own config; drop {', '.join(given)}")
        if out:
            check_run_dir(out, run_id=resume_run)
        summary = resume_train_rl(resume_run, out=out, register=register, echo=echo)
    else:
        if out:  # before the default world is built; run_train_rl checks again with the resolved inputs
            check_run_dir(out, overwrite=overwrite)
        world_dir = _world_dir(world) if not config_path else world
        cfg = _rl_config(ctx, world_dir, config_path, overrides, options)
        summary = run_train_rl(cfg, world_dir=world_dir, out=out, run_name=run_name, register=register, echo=echo,
                               overwrite=overwrite)
    click.echo(json.dumps(summary, indent=1))


def _world_file(world_dir: str | None, given: str | None, *rel: str) -> str:
    """An explicitly given path, else the file at `rel` inside the world."""
    return given or os.path.join(world_dir, *rel)


@cli.command("dev-eval")
@click.option("--policy", required=True, help="Policy checkpoint directory or a models:/ URI.")
@click.option("--world", default=None, help="World whose files fill the options below (default: the default world).")
@click.option("--policy-ref", default=None, help="Reference policy directory (default: <world>/policy).")
@click.option("--reward-model", default=None, help="Reward-model directory (default: <world>/reward_model).")
@click.option("--prompts", default=None, help="Dev prompts JSONL (default: <world>/data/prompts_dev.jsonl).")
@click.option("--gold", default=None, help="Expert gold JSONL (default: <world>/data/gold_calib.jsonl).")
@click.option("--n", type=int, default=1, show_default=True, help="Samples per prompt.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--out", default=None, help="Also write the metrics JSON here.")
def dev_eval_cmd(policy, world, policy_ref, reward_model, prompts, gold, n, seed, out):
    """The seed's dev evaluation, plus per family, as an MLflow run linked to the policy's model."""
    from .steps import run_dev_eval
    if out:
        check_writable(out)
    world_dir = None if (policy_ref and reward_model and prompts) else _world_dir(world)
    policy_ref = _world_file(world_dir, policy_ref, "policy")
    reward_model = _world_file(world_dir, reward_model, "reward_model")
    prompts = _world_file(world_dir, prompts, "data", "prompts_dev.jsonl")
    gold = gold or (os.path.join(world_dir, "data", "gold_calib.jsonl") if world_dir else None)
    metrics = run_dev_eval(policy, policy_ref, reward_model, prompts, gold, n, seed, out=out)
    click.echo(json.dumps(metrics, indent=1))


@cli.command("bon")
@click.option("--policy", required=True, help="Policy checkpoint directory.")
@click.option("--reward-model", required=True, help="Reward-model directory.")
@click.option("--prompts", required=True, help="Prompts JSONL.")
@click.option("--n", type=click.IntRange(1), default=32, show_default=True, help="Samples per prompt.")
@click.option("--limit", type=click.IntRange(1), default=None, help="Use only the first LIMIT prompts.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", default=None, help="Write the chosen samples here (JSONL).")
def bon_cmd(policy, reward_model, prompts, n, limit, seed, out):
    """Best-of-N selection against a reward model, as an MLflow run."""
    import tempfile

    from . import data as D
    from . import model as M
    from . import reward_model as R
    from .bon import best_of_n
    from .tracking import runs as T
    from .tracking.policy_model import resolve_policy
    if out:
        check_writable(out)
    records = D.read_jsonl(prompts)
    params = {"policy": policy, "reward_model": reward_model, "prompts": prompts, "n": n, "limit": limit,
              "seed": seed}
    with T.tracked_run("bon", params), tempfile.TemporaryDirectory() as tmp:
        policy_dir, model_id = resolve_policy(policy)
        recs = records[:limit]
        T.log_records_input(records, prompts, "prompts")
        samples, metrics = best_of_n(M.load_policy(policy_dir)[0], R.load_rm(reward_model)[0], recs, n, seed=seed)
        path = out or os.path.join(tmp, "samples.jsonl")
        D.write_jsonl(path, samples)
        T.log_artifact(path, "samples")
        T.log_metrics(metrics, model_id=model_id)
    click.echo(json.dumps(metrics, indent=1))


@cli.command("train-rm")
@click.option("--data", required=True, help="Labelled records JSONL (response + label).")
@click.option("--out", required=True, help="Output directory for rm.safetensors + config.json.")
@click.option("--epochs", type=int, default=40, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--batch-size", type=int, default=128, show_default=True)
@click.option("--lr-schedule", type=click.Choice(["constant", "cosine"]), default="constant", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--gold", default=None, help="Expert gold JSONL: also report per-family agreement with it.")
def train_rm_cmd(data, out, epochs, lr, batch_size, lr_schedule, seed, gold):
    """Train a reward model on labelled records (MSE), as an MLflow run."""
    from dataclasses import asdict

    from . import data as D
    from . import reward_model as R
    from .tracking import runs as T
    from .train_rm import RMConfig, per_family_fit, train_rm
    check_writable(out, directory=True)
    cfg = RMConfig(epochs=epochs, lr=lr, batch_size=batch_size, lr_schedule=lr_schedule, seed=seed)
    records = D.read_jsonl(data, labelled=True)
    gold_recs = D.read_jsonl(gold, labelled=True) if gold else None
    with T.tracked_run("train_rm", {**asdict(cfg), "data": data, "gold": gold}):
        T.log_records_input(records, data, "training")
        logger = T.MetricLogger()

        def on_log(epoch, m):
            logger(epoch, m)
            click.echo(f"epoch {epoch}: loss {m['loss']:.4f}", err=True)

        rm, info = train_rm(records, cfg, on_log=on_log)
        logger.flush()
        R.save_rm(rm, info["config"], out)
        metrics = {f"label_pearson/{f}": v["pearson"] for f, v in info["fit"].items()}
        if gold:
            scores = R.score(rm, D.prompts_tensor(gold_recs), D.responses_tensor(gold_recs))
            fit = per_family_fit(scores, D.labels_tensor(gold_recs), D.family_index(gold_recs))
            metrics.update({f"gold_pearson/{f}": v["pearson"] for f, v in fit.items()})
        T.log_metrics(metrics)
        T.log_artifact(out, "reward_model")
    click.echo(json.dumps({"out": os.path.abspath(out), "fit": info["fit"]}, indent=1))


@cli.command("runs")
@click.option("--step", default="train_rl", show_default=True, help="Pipeline step (train_rl, dev_eval, ...).")
@click.option("--metric", default="proxy/balanced", show_default=True, help="Sort by this metric.")
@click.option("--tidy", is_flag=True, help="Print the tidy per-family frame instead of the leaderboard.")
@click.option("--repair", is_flag=True,
              help="Instead: mark RUNNING runs whose process is gone FAILED, clear a stale release lock, "
                   "settle cut-short releases.")
@click.option("--dry-run", is_flag=True, help="With --repair: say what would be done, change nothing.")
def runs_cmd(step, metric, tidy, repair, dry_run):
    """Print run history: a leaderboard (or the tidy per-family frame) from the tracking store."""
    if repair:
        from .tracking.repair import repair as repair_store
        lines = repair_store(dry_run)
        click.echo("\n".join(lines) if lines else "nothing to repair")
        return
    if dry_run:
        raise click.UsageError("--dry-run goes with --repair")
    import pandas as pd

    from . import history
    frame = history.runs(step=step)
    out = history.family_frame(frame) if tidy else history.leaderboard(frame, metric)
    with pd.option_context("display.max_rows", 200, "display.width", 200, "display.max_columns", 30):
        click.echo(out.to_string(index=False) if len(out) else f"no {step} runs with metric {metric}")


@cli.command("replay-history")
@click.option("--world", default=None, help="World directory (default: the default world, built on first use).")
@click.option("--steps-scale", type=float, default=1.0, show_default=True,
              help="Multiply each recipe's steps (for a quick look).")
@click.option("--only", multiple=True, help="Replay only these runs (repeatable).")
def replay_history_cmd(world, steps_scale, only):
    """Train the seed's five historical runs and log them with the seed's notes as descriptions."""
    from .recipes import SEED_HISTORY
    from .rl_config_io import load_rl_config, recipe_overrides
    from .rl_run import run_train_rl
    world_dir = _world_dir(world)
    unknown = [n for n in only if n not in SEED_HISTORY]
    if unknown:
        raise InputError(f"--only: unknown run {unknown[0]!r}; valid runs are {list(SEED_HISTORY)}")
    out = []
    for name, (overrides, note) in SEED_HISTORY.items():
        if only and name not in only:
            continue
        ov = dict(overrides, steps=max(1, int(overrides["steps"] * steps_scale)))
        cfg = load_rl_config(os.path.join(world_dir, "configs", "default.json"), recipe_overrides(ov))
        click.echo(f"replaying {name}: {note}", err=True)
        out.append(run_train_rl(cfg, world_dir=world_dir, run_name=name, description=note,
                                tags={"rlhf.history": "seed"}, echo=lambda m: click.echo(m, err=True)))
    click.echo(json.dumps(out, indent=1))


@cli.command("diagnostic")
@click.option("--world", default=None, help="World whose files fill the options below (default: the default world).")
@click.option("--rm-dir", default=None, help="Reward-model directory with its QA sample train.jsonl.")
@click.option("--policy-dir", default=None, help="Reference policy directory.")
@click.option("--prompts", default=None, help="Prompts JSONL (default: <world>/data/prompts_train.jsonl).")
@click.option("--n-prompts", type=int, default=24, show_default=True, help="Reference responses per family.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--out", default=None, help="Also write the result JSON here.")
def diagnostic_cmd(world, rm_dir, policy_dir, prompts, n_prompts, seed, out):
    """Gold-free reward-shortcut audit per family, as an MLflow run."""
    from .steps import run_diagnostic_step
    if out:
        check_writable(out)
    world_dir = None if (rm_dir and policy_dir and prompts) else _world_dir(world)
    rm_dir = _world_file(world_dir, rm_dir, "reward_model")
    policy_dir = _world_file(world_dir, policy_dir, "policy")
    prompts = _world_file(world_dir, prompts, "data", "prompts_train.jsonl")
    result = run_diagnostic_step(rm_dir, policy_dir, prompts, n_prompts, seed, out=out)
    fams = result["families"]
    click.echo(json.dumps({f: {"risk": round(v["risk"], 3), "flag": v["flag"], "top": v["evidence"][0]}
                           for f, v in fams.items()}, indent=1))


@cli.command("correct")
@click.option("--diagnostic", required=True, help="Result JSON of `diagnostic --out`.")
@click.option("--qa", required=True, help="The reward model's QA sample (reward_model/train.jsonl).")
@click.option("--out", required=True, help="Reward-wrapper file to write (pass it to train-rl --reward-wrapper).")
def correct_cmd(diagnostic, qa, out):
    """Fit corrections for the flagged shortcuts on the QA sample and write a reward wrapper."""
    from .steps import run_correction
    check_writable(out)
    rules = run_correction(diagnostic, qa, out)
    click.echo(json.dumps({"wrapper": os.path.abspath(out), "rules": rules}, indent=1))


def _register_commands() -> None:
    from .cli_release import COMMANDS
    for command in COMMANDS:
        cli.add_command(command)


_register_commands()


# scale-out: `sweep` (Ray Tune) and `server` (MLflow on PostgreSQL), in their own module
from .cli_scale import COMMANDS as SCALE_OUT_COMMANDS  # noqa: E402

for _command in SCALE_OUT_COMMANDS:
    cli.add_command(_command)
