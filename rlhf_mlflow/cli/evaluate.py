"""`rlhf-mlflow dev-eval | diagnostic | correct`: evaluation and the gold-free shortcut audit."""
from __future__ import annotations

import os

import click

from rlhf_mlflow.cli.options import SEED, echo_json, resolve_world

fills_option = click.option("--world", default=None,
                            help="World whose files fill the options below (default: the default world).")
policy_impl_option = click.option(
    "--policy-impl", default=None, metavar="MODULE:FACTORY",
    help="Open the policy with this factory (an import path, called with the policy's location) instead of as "
         "our checkpoint: any implementation of the model protocol (core/protocol.py).")
reward_impl_option = click.option(
    "--reward-impl", default=None, metavar="MODULE:FACTORY",
    help="Open the reward model with this factory (an import path, called with its location) instead of as ours.")


@click.command("dev-eval")
@click.option("--policy", required=True, help="Policy checkpoint directory or a models:/ URI.")
@fills_option
@click.option("--policy-ref", default=None, help="Reference policy directory (default: <world>/policy).")
@click.option("--reward-model", default=None, help="Reward-model directory (default: <world>/reward_model).")
@click.option("--prompts", default=None, help="Dev prompts JSONL (default: <world>/data/prompts_dev.jsonl).")
@click.option("--gold", default=None, help="Expert gold JSONL (default: <world>/data/gold_calib.jsonl).")
@click.option("--n", type=click.IntRange(1, 1024), default=1, show_default=True, help="Samples per prompt.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Sampling seed.")
@click.option("--out", default=None, help="Also write the metrics JSON here.")
@policy_impl_option
@reward_impl_option
def dev_eval_cmd(policy, world, policy_ref, reward_model, prompts, gold, n, seed, out, policy_impl, reward_impl):
    """The seed's dev evaluation, plus per family, as an MLflow run linked to the policy's model."""
    from rlhf_mlflow.steps.dev_eval import run_dev_eval
    from rlhf_mlflow.steps.outputs import check_out
    if out:  # before the default world is built; the step checks again with its inputs
        check_out(out)
    paths = None if (policy_ref and reward_model and prompts) else resolve_world(world)
    metrics = run_dev_eval(policy, policy_ref or paths.policy, reward_model or paths.reward_model,
                           prompts or paths.prompts_dev, gold or (paths.expert_set if paths else None), n, seed, out=out,
                           policy_impl=policy_impl, reward_impl=reward_impl)
    echo_json(metrics)


@click.command("diagnostic")
@fills_option
@click.option("--rm-dir", default=None, help="Reward-model directory with its QA sample train.jsonl.")
@click.option("--policy-dir", default=None, help="Reference policy directory.")
@click.option("--prompts", default=None, help="Prompts JSONL (default: <world>/data/prompts_train.jsonl).")
@click.option("--gold", default=None,
              help="Optional expert set (labelled reference samples): credits what its labels show to be correctness.")
@click.option("--n-prompts", type=click.IntRange(2, 10_000), default=48, show_default=True,
              help="Probe prompts per family (two reference responses each).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Sampling seed.")
@click.option("--out", default=None, help="Also write the result JSON here.")
@policy_impl_option
@reward_impl_option
def diagnostic_cmd(world, rm_dir, policy_dir, prompts, gold, n_prompts, seed, out, policy_impl, reward_impl):
    """Gold-free reward-shortcut audit per family, as an MLflow run."""
    from rlhf_mlflow.steps.diagnostic import run_diagnostic_step
    from rlhf_mlflow.steps.outputs import check_out
    if out:  # before the default world is built; the step checks again with its inputs
        check_out(out)
    paths = None if (rm_dir and policy_dir and prompts) else resolve_world(world)
    result = run_diagnostic_step(rm_dir or paths.reward_model, policy_dir or paths.policy,
                                 prompts or paths.prompts_train, n_prompts, seed, out=out, gold=gold,
                                 policy_impl=policy_impl, reward_impl=reward_impl)
    echo_json({f: {"risk": round(v["risk"], 3), "flag": v["flag"], "top": v["evidence"][0]}
               for f, v in result["families"].items()})


@click.command("correct")
@click.option("--diagnostic", required=True, help="Result JSON of `diagnostic --out`.")
@click.option("--qa", required=True, help="The reward model's QA sample (reward_model/train.jsonl).")
@click.option("--out", required=True, help="Reward-wrapper file to write (pass it to train-rl --reward-wrapper).")
def correct_cmd(diagnostic, qa, out):
    """Fit corrections for the flagged shortcuts on the QA sample and write a reward wrapper."""
    from rlhf_mlflow.steps.correct import run_correction
    rules = run_correction(diagnostic, qa, out)
    echo_json({"wrapper": os.path.abspath(out), "rules": rules})


COMMANDS = (dev_eval_cmd, diagnostic_cmd, correct_cmd)
