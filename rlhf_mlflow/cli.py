"""`rlhf-mlflow`: one command per MLproject entry point."""
from __future__ import annotations

import json
import logging
import os
import sys

import click

from .errors import InputError

DEFAULT_WORLDS = "worlds"


def _setup() -> None:
    from .runtime import configure_threads
    configure_threads()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


class Group(click.Group):
    """Turns InputError into one clear error line and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            raise click.ClickException(str(e)) from None


@click.group(cls=Group)
def cli():
    """A small RLHF pipeline in pure PyTorch where every step is an MLflow run."""
    _setup()


@cli.command("build-world")
@click.option("--seed", type=int, default=0, show_default=True, help="World seed.")
@click.option("--spec", default="default", show_default=True,
              help="Corruption spec: 'default' (dune pa +1.45, ember he +0.47), 'clean', or a JSON file.")
@click.option("--scale", type=click.Choice(["full", "test"]), default="full", show_default=True,
              help="'test' builds a small world in seconds.")
@click.option("--out", default=None, help="Output directory (default: worlds/<hash>, reused when it exists).")
def build_world_cmd(seed, spec, scale, out):
    """Build (or reuse) a synthetic world with a hidden truth."""
    from .world import corruptions as C
    from .world.build import build_world, ensure_world
    rules = C.load_spec(spec)
    if out:
        manifest = build_world(out, seed, rules, scale, progress=click.echo)
        path = out
    else:
        path, manifest = ensure_world(DEFAULT_WORLDS, seed, rules, scale, progress=click.echo)
    click.echo(json.dumps({"world": os.path.abspath(path), "world_hash": manifest["world_hash"],
                           "timings": manifest["timings"]}, indent=1))


@cli.command("train-rl")
@click.option("--config", "config_path", default=None, help="JSON recipe (e.g. <world>/configs/default.json).")
@click.option("--override", "overrides", multiple=True, help="key=value, repeatable; value parsed as JSON.")
@click.option("--out", required=True, help="Output directory for the checkpoint, run_config.json and log.jsonl.")
def train_rl_cmd(config_path, overrides, out):
    """KL-regularised REINFORCE against a reward model."""
    from . import model as M
    from .rl_config_io import load_rl_config
    from .train_rl import train_rl
    from dataclasses import asdict
    cfg = load_rl_config(config_path, list(overrides))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "run_config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    with open(os.path.join(out, "log.jsonl"), "w") as logf:
        def on_log(step, metrics):
            logf.write(json.dumps({"step": step, **metrics}) + "\n")
            logf.flush()
            click.echo(f"step {step}: proxy {metrics['proxy/balanced']:.3f} kl {metrics['kl/balanced']:.3f} "
                       f"({metrics['steps_per_s']:.1f} steps/s)", err=True)

        def on_checkpoint(step, policy):
            M.save_policy(policy, policy.cfg, os.path.join(out, f"step_{step}"))

        result = train_rl(cfg, on_log=on_log, on_checkpoint=on_checkpoint)
    M.save_policy(result.policy, result.policy_config, out)
    click.echo(json.dumps({"out": os.path.abspath(out), "seconds": round(result.seconds, 1),
                           **result.history[-1][1]}, indent=1))


@cli.command("dev-eval")
@click.option("--policy", required=True, help="Policy checkpoint directory.")
@click.option("--policy-ref", required=True, help="Reference policy directory.")
@click.option("--reward-model", required=True, help="Reward-model directory.")
@click.option("--prompts", required=True, help="Dev prompts JSONL.")
@click.option("--gold", default=None, help="Expert gold JSONL (for rm_gold_pearson).")
@click.option("--n", type=int, default=1, show_default=True, help="Samples per prompt.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", default=None, help="Write the metrics JSON here.")
def dev_eval_cmd(policy, policy_ref, reward_model, prompts, gold, n, seed, out):
    """The seed's dev evaluation, plus per family."""
    from . import data as D
    from . import model as M
    from . import reward_model as R
    from .evaluate import dev_eval
    res = dev_eval(M.load_policy(policy)[0], M.load_policy(policy_ref)[0], R.load_rm(reward_model)[0],
                   D.read_jsonl(prompts), D.read_jsonl(gold, labelled=True) if gold else None, n, seed)
    text = json.dumps(res.metrics, indent=1)
    if out:
        with open(out, "w") as f:
            f.write(text)
    click.echo(text)


@cli.command("bon")
@click.option("--policy", required=True, help="Policy checkpoint directory.")
@click.option("--reward-model", required=True, help="Reward-model directory.")
@click.option("--prompts", required=True, help="Prompts JSONL.")
@click.option("--n", type=click.IntRange(1), default=32, show_default=True, help="Samples per prompt.")
@click.option("--limit", type=click.IntRange(1), default=None, help="Use only the first LIMIT prompts.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", default=None, help="Write the chosen samples here (JSONL).")
def bon_cmd(policy, reward_model, prompts, n, limit, seed, out):
    """Best-of-N selection against a reward model."""
    from . import data as D
    from . import model as M
    from . import reward_model as R
    from .bon import best_of_n
    recs = D.read_jsonl(prompts)[:limit]
    samples, metrics = best_of_n(M.load_policy(policy)[0], R.load_rm(reward_model)[0], recs, n, seed=seed)
    if out:
        D.write_jsonl(out, samples)
    click.echo(json.dumps(metrics, indent=1))


@cli.command("train-rm")
@click.option("--data", "data_path", required=True, help="Labelled records JSONL (response + label).")
@click.option("--out", required=True, help="Output directory for rm.safetensors + config.json.")
@click.option("--epochs", type=int, default=40, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--batch-size", type=int, default=128, show_default=True)
@click.option("--lr-schedule", type=click.Choice(["constant", "cosine"]), default="constant", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def train_rm_cmd(data_path, out, epochs, lr, batch_size, lr_schedule, seed):
    """Train a reward model on labelled records (MSE)."""
    from . import data as D
    from . import reward_model as R
    from .train_rm import RMConfig, train_rm
    cfg = RMConfig(epochs=epochs, lr=lr, batch_size=batch_size, lr_schedule=lr_schedule, seed=seed)
    rm, info = train_rm(D.read_jsonl(data_path, labelled=True), cfg,
                        on_log=lambda e, m: click.echo(f"epoch {e}: loss {m['loss']:.4f}", err=True))
    R.save_rm(rm, info["config"], out)
    click.echo(json.dumps({"out": os.path.abspath(out), "fit": info["fit"]}, indent=1))
