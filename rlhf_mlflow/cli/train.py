"""`rlhf-mlflow train-rl | train-rm | bon | replay-history`: training commands."""
from __future__ import annotations

import os

import click

from rlhf_mlflow.training.recipes import MAX_STEPS_SCALE, check_steps_scale

from rlhf_mlflow.cli.options import (
    SEED,
    Finite,
    check_rl_options,
    echo_err,
    echo_json,
    given,
    overwrite_option,
    resolve_world,
    rl_config,
    rl_options,
    world_for_config,
    world_option,
)


@click.command("train-rl")
@world_option
@click.option("--config", "config_path", default=None, help="JSON recipe (default: <world>/configs/default.json).")
@click.option("--override", "overrides", multiple=True, help="key=value, repeatable; value parsed as JSON.")
@rl_options
@click.option("--out", default=None, help="Also write the checkpoint, run_config.json and log.jsonl here "
              "(a new or empty directory, or one this run's marker .rlhf_run.json claims).")
@overwrite_option("another train_rl run's directory", ", deleting what it holds first")
@click.option("--run-name", default=None, help="MLflow run name (default: kl<kl_coef>-s<steps>).")
@click.option("--register/--no-register", default=True, show_default=True,
              help="Register the final policy as a new version of rlhf-policy.")
@click.option("--resume", "resume_run", default=None, metavar="RUN_ID",
              help="Continue this train_rl run that died, from its newest complete checkpoint, in the same "
              "MLflow run (one started with --no-register stays unregistered).")
@click.pass_context
def train_rl_cmd(ctx, world, config_path, overrides, out, overwrite, run_name, register, resume_run, **options):
    """KL-regularised REINFORCE against a reward model, as an MLflow run."""
    from rlhf_mlflow.steps.outputs import check_out_dir
    from rlhf_mlflow.steps.train_rl import STEP, resume_train_rl, run_train_rl
    if resume_run:
        extra = given(ctx, ("world", "config_path", "overrides", "run_name", "overwrite", *options))
        if extra:
            raise click.UsageError(f"--resume continues the run with its own config; drop {', '.join(extra)}")
        if out:
            check_out_dir(out, STEP, run_id=resume_run)
        echo_json(resume_train_rl(resume_run, out=out, register=register, echo=echo_err))
        return
    check_rl_options(ctx, overrides, options)  # before the default world is built or a run starts
    if out:  # before the default world is built; run_train_rl checks again with the resolved inputs
        check_out_dir(out, STEP, overwrite=overwrite)
    paths = world_for_config(world, config_path)
    cfg = rl_config(ctx, paths, config_path, overrides, options)
    echo_json(run_train_rl(cfg, world=paths, out=out, run_name=run_name, register=register, echo=echo_err,
                           overwrite=overwrite))


@click.command("train-rm")
@click.option("--data", required=True, help="Labelled records JSONL (response + label).")
@click.option("--out", required=True, help="Output directory for rm.safetensors + config.json (new or empty; "
              "marked .rlhf_run.json as this run's).")
@overwrite_option("another train_rm run's directory")
@click.option("--epochs", type=click.IntRange(1, 10_000), default=40, show_default=True)
@click.option("--lr", type=Finite(0, 1, min_open=True), default=2e-3, show_default=True)
@click.option("--batch-size", type=click.IntRange(1, 1_000_000), default=128, show_default=True)
@click.option("--lr-schedule", type=click.Choice(["constant", "cosine"]), default="constant", show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--gold", default=None, help="Expert gold JSONL: also report per-family agreement with it.")
def train_rm_cmd(data, out, overwrite, epochs, lr, batch_size, lr_schedule, seed, gold):
    """Train a reward model on labelled records (MSE), as an MLflow run."""
    from rlhf_mlflow.steps.train_rm import run_train_rm
    from rlhf_mlflow.training.train_rm import RMConfig
    cfg = RMConfig(epochs=epochs, lr=lr, batch_size=batch_size, lr_schedule=lr_schedule, seed=seed)
    fit = run_train_rm(data, out, cfg, gold, echo=echo_err, overwrite=overwrite)
    echo_json({"out": os.path.abspath(out), "fit": fit})


@click.command("bon")
@click.option("--policy", required=True, help="Policy checkpoint directory.")
@click.option("--reward-model", required=True, help="Reward-model directory.")
@click.option("--prompts", required=True, help="Prompts JSONL.")
@click.option("--n", type=click.IntRange(1, 4096), default=32, show_default=True, help="Samples per prompt.")
@click.option("--limit", type=click.IntRange(1), default=None, help="Use only the first LIMIT prompts.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--out", default=None, help="Write the chosen samples here (JSONL).")
@click.option("--watch-gold", default=None,
              help="An expert set (labelled reference samples, JSONL, e.g. a world's data/gold_calib.jsonl): "
                   "also estimate each family's true quality of best-of-n at n = 1, 2, 4, ..., N and fit "
                   "the best-of-n form (docs/WATCH.md).")
@click.option("--watch-correction", default=None,
              help="With --watch-gold: a reward wrapper (the diagnostic's correction) applied in the estimates.")
def bon_cmd(policy, reward_model, prompts, n, limit, seed, out, watch_gold, watch_correction):
    """Best-of-N selection against a reward model, as an MLflow run."""
    from rlhf_mlflow.steps.bon import run_bon
    if watch_correction and not watch_gold:
        raise click.UsageError("--watch-correction needs --watch-gold (the expert set the estimates come from)")
    echo_json(run_bon(policy, reward_model, prompts, n, limit, seed, out, watch_gold, watch_correction))


@click.command("replay-history")
@world_option
@click.option("--steps-scale", type=float, default=1.0, show_default=True,
              help=f"Multiply each recipe's steps (for a quick look; in (0, {MAX_STEPS_SCALE:g}]).")
@click.option("--only", multiple=True, help="Replay only these runs (repeatable).")
def replay_history_cmd(world, steps_scale, only):
    """Train the seed's five historical runs and log them with the seed's notes as descriptions."""
    from rlhf_mlflow.steps.replay_history import check_names, run_replay_history
    check_names(only)  # before the default world is built
    check_steps_scale(steps_scale)
    echo_json(run_replay_history(resolve_world(world), steps_scale, only, echo=echo_err))


COMMANDS = (train_rl_cmd, train_rm_cmd, bon_cmd, replay_history_cmd)
