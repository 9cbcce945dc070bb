"""`rlhf-mlflow label-requests | expert-label | repair-rm`: buying expert labels on a candidate's own responses,
and repairing the reward model with them."""
from __future__ import annotations

import click

from rlhf_mlflow.cli.options import SEED, Finite, echo_err, echo_json, overwrite_option, resolve_world, world_option
from rlhf_mlflow.training.repair_rm import RepairConfig as RepairDefaults


@click.command("label-requests")
@click.option("--model-version", default=None, help="The rlhf-policy version whose responses are to be labelled.")
@click.option("--samples", default=None,
              help="Or a table of a policy's samples (JSONL, CSV or Parquet; see certify-table): the requests are "
                   "rows of it, one per prompt, no model needed.")
@world_option
@click.option("--families", default="auto", show_default=True,
              help="auto (the families its certification refused off-policy), all, or F,G,...")
@click.option("--per-family", type=click.IntRange(1, 10_000), default=10, show_default=True,
              help="Requests per family (the first K of a fixed order: a larger K extends a smaller one).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the prompt order and the responses.")
@click.option("--out", default="label_requests.jsonl", show_default=True, help="The requests (JSONL, no labels).")
def label_requests_cmd(model_version, samples, world, families, per_family, seed, out):
    """Ask for expert labels on a version's own responses (expert-set prompts), as an MLflow run."""
    from rlhf_mlflow.steps.label_requests import run_label_requests, run_table_requests
    from rlhf_mlflow.steps.outputs import check_out
    if bool(model_version) == bool(samples):
        raise click.UsageError("give exactly one of --model-version or --samples")
    if samples:
        echo_json(run_table_requests(samples, "all" if families == "auto" else families, per_family, seed, out,
                                     echo=echo_err))
        return
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


@click.command("repair-rm")
@world_option
@click.option("--labels", required=True,
              help="Comma-separated expert labels files bought on policies' own responses (the expert set is "
                   "always included).")
@click.option("--diagnostic", default=None,
              help="The diagnostic's evidence JSON for the parent: its flagged premiums are taken out of the crowd's "
                   "labels, and the repaired model may not be flagged for them again.")
@click.option("--parent-version", default=None,
              help="The rlhf-reward-model version to repair (default: this world's production, else its own model).")
@click.option("--out", required=True, help="The repaired reward model's directory (seed format): new or empty; "
              "marked .rlhf_run.json as this run's.")
@overwrite_option("another repair_rm run's directory")
@click.option("--epochs", type=click.IntRange(1, 10_000), default=RepairDefaults.epochs, show_default=True,
              help="Fine-tuning passes over the repair data.")
@click.option("--lr", type=Finite(0, 1, min_open=True), default=RepairDefaults.lr, show_default=True,
              help="Fine-tuning learning rate.")
@click.option("--crowd-weight", type=Finite(0, 100), default=RepairDefaults.crowd_weight, show_default=True,
              help="Multiplier on the crowd QA sample's noise weight (0: not used).")
@click.option("--ensemble", type=click.IntRange(0, 32), default=0, show_default=True,
              help="Also train this many ensemble members on the same data (bootstraps with new heads), written to "
                   "OUT/ensemble: train-rl's reward_ensemble, with ensemble_penalty k for mean - k x spread.")
@click.option("--label-head", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="Also fit a label head on the expert labels (a sparse table of which token at which position "
                   "goes with which prompt attribute) and stack it on the fine-tuned model by cross-validation.")
@click.option("--seed", type=SEED, default=0, show_default=True)
def repair_rm_cmd(world, labels, diagnostic, parent_version, out, overwrite, epochs, lr, crowd_weight, ensemble,
                  label_head, seed):
    """Repair the reward model with every expert label so far; register it; promote it to production only
    if it agrees with the experts at least as well as its parent and pays no flagged shortcut again."""
    from rlhf_mlflow.steps.outputs import check_out_dir
    from rlhf_mlflow.steps.repair_rm import reads, run_repair_rm
    from rlhf_mlflow.training.repair_rm import STEP, RepairConfig
    paths = [p.strip() for p in labels.split(",") if p.strip()]
    # before the default world is built; the step checks again with it
    check_out_dir(out, STEP, reads(None, diagnostic, paths), overwrite=overwrite)
    cfg = RepairConfig(epochs=epochs, lr=lr, crowd_weight=crowd_weight, ensemble=ensemble,
                       label_head=label_head == "on", seed=seed)
    result = run_repair_rm(resolve_world(world), paths, out, diagnostic, parent_version, cfg, echo=echo_err,
                           overwrite=overwrite)
    echo_json({k: result[k] for k in ("version", "parent_version", "promoted", "gate", "out", "run_id")})


COMMANDS = (label_requests_cmd, expert_label_cmd, repair_rm_cmd)
