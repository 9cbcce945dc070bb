"""`rlhf-mlflow certify-table`: certify (and register) a policy trained anywhere from a table of its samples."""
from __future__ import annotations

import click

from rlhf_mlflow.cli.options import SEED, echo_err, echo_json, world_option


@click.command("certify-table")
@click.option("--samples", required=True,
              help="The policy's samples: JSONL, CSV or Parquet with id, family, prompt (or the seed's attrs), "
                   "response, score (the reward model's), optional logp_policy and logp_reference.")
@click.option("--labels", required=True, help="Expert labels on some of the samples: id, label.")
@click.option("--expert-set", default=None,
              help="Labelled reference samples (default with --world: its data/gold_calib.jsonl): the reference's "
                   "quality; with score, the predictor's calibration; with logp_policy and logp_reference, "
                   "off-policy evidence.")
@world_option
@click.option("--diagnostic", default=None,
              help="Diagnostic evidence JSON: its flagged shortcuts are counted in rows that carry the seed's tokens.")
@click.option("--model-version", default=None, help="The rlhf-policy version these are samples of.")
@click.option("--register", "register", default=None, metavar="NAME",
              help="Or register the policy as a new rlhf-policy version under this name (its recipe tag).")
@click.option("--model-uri", default=None, help="With --register: where the policy lives (any MLflow model URI or path).")
@click.option("--min-labels", type=click.IntRange(2, 1_000_000), default=20, show_default=True,
              help="Labels a family needs to be certified from them.")
@click.option("--label-looks", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Rounds of labels looked at so far: every interval is union-bounded over them.")
@click.option("--label-spending", default="", metavar="S1,S2,...",
              help="Or shares of the error budget per look, fixed before the first (e.g. 0.7,0.1,0.1,0.1; adding up "
                   "to at most 1): the look is counted from the store's certify runs of the version.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the bootstrap and folds.")
@click.option("--out", default=None, help="Also write the certification JSON here.")
def certify_table_cmd(samples, labels, expert_set, world, diagnostic, model_version, register, model_uri,
                      min_labels, label_looks, label_spending, seed, out):
    """Certify a policy trained elsewhere from its samples and expert labels, as a certify run."""
    from rlhf_mlflow.core.world_paths import WorldPaths
    from rlhf_mlflow.decisions.certify import CertifyConfig
    from rlhf_mlflow.steps.certify_table import run_certify_table
    res = run_certify_table(samples, labels, expert_set, diagnostic, model_version, register, model_uri,
                            WorldPaths.at(world) if world else None,
                            CertifyConfig(min_labels=min_labels, label_looks=label_looks, label_spending=label_spending,
                                          seed=seed), out=out,
                            echo=echo_err)
    echo_json({"run_id": res["run_id"], "model_version": res["model_version"], "balanced": res["report"]["balanced"]})


COMMANDS = (certify_table_cmd,)
