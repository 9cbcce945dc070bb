"""`rlhf-mlflow label-requests | expert-label`: buying expert labels on a candidate's own responses."""
from __future__ import annotations

import click

from rlhf_mlflow.cli.options import echo_err, echo_json, resolve_world, world_option


@click.command("label-requests")
@click.option("--model-version", required=True, help="The rlhf-policy version whose responses are to be labelled.")
@world_option
@click.option("--families", default="auto", show_default=True,
              help="auto (the families its certification refused off-policy), all, or F,G,...")
@click.option("--per-family", type=click.IntRange(1), default=10, show_default=True,
              help="Requests per family (the first K of a fixed order: a larger K extends a smaller one).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompt order and the responses.")
@click.option("--out", default="label_requests.jsonl", show_default=True, help="The requests (JSONL, no labels).")
def label_requests_cmd(model_version, world, families, per_family, seed, out):
    """Ask for expert labels on a version's own responses (expert-set prompts), as an MLflow run."""
    from rlhf_mlflow.steps.label_requests import run_label_requests
    from rlhf_mlflow.steps.outputs import check_out
    check_out(out)  # before the default world is built; the step checks again with its inputs
    echo_json(run_label_requests(model_version, resolve_world(world), families, per_family, seed, out, echo=echo_err))


@click.command("expert-label")
@world_option
@click.option("--requests", required=True, help="A label-requests JSONL file.")
@click.option("--out", required=True, help="The labelled records (JSONL: the requests with `label` added).")
def expert_label_cmd(world, requests, out):
    """The synthetic world's expert labels the requests (truth + the expert set's noise)."""
    from rlhf_mlflow.steps.expert_label import run_expert_label
    from rlhf_mlflow.steps.outputs import check_out
    check_out(out, {"--requests": requests})  # before the default world is built; the step checks again
    labels = run_expert_label(resolve_world(world), requests, out, echo=echo_err)
    echo_json({"labels": len(labels), "out": out})


COMMANDS = (label_requests_cmd, expert_label_cmd)
