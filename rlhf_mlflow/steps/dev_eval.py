"""The `dev_eval` step: the seed's dev evaluation of a policy (a checkpoint, a models:/ URI of any pyfunc
model that speaks tracking/pyfunc_protocol.py's frame contract, or any implementation of core/protocol.py
named by `--policy-impl`) as an MLflow run, linked to the policy's LoggedModel when it has one: the summary
numbers as `dev/...` metrics, per family a table and a figure."""
from __future__ import annotations

import pandas as pd

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.files import atomic_write_json
from rlhf_mlflow.core.own_models import open_policy, open_reward_model
from rlhf_mlflow.steps.figures import family_bars
from rlhf_mlflow.steps.outputs import check_out
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.pyfunc_protocol import resolve
from rlhf_mlflow.training.evaluate import dev_eval


CHARTED = ("proxy/balanced", "kl/balanced", "proxy_mean", "proxy_std", "proxy_p50", "proxy_p90", "kl_mean",
           "rm_gold_pearson")
"""The numbers a reader compares across policies, logged as `dev/<name>`; per family they are in the
table FAMILY_TABLE and the figure, and every number in `dev_eval.json`."""
FAMILY_TABLE = "dev_eval_families.json"


def family_table(metrics: dict) -> pd.DataFrame:
    """One row per family (then balanced, pilot): proxy, kl and the reward model's fit to the expert set."""
    names = ("proxy", "kl", "rm_gold_pearson")
    rows = [{"family": f, **{n: metrics.get(f"{n}/{f}") for n in names}} for f in [*V.FAMILIES, "balanced", "pilot"]
            if f"proxy/{f}" in metrics]
    return pd.DataFrame(rows, columns=["family", *names])


def run_dev_eval(policy: str, policy_ref: str, reward_model: str, prompts: str, gold: str | None = None,
                 n: int = 1, seed: int = 0, run_name: str | None = None, out: str | None = None,
                 policy_impl: str | None = None, reward_impl: str | None = None) -> dict:
    """The seed's dev evaluation of a checkpoint directory or models:/ URI; metrics are linked to the
    policy's LoggedModel when it has one. `out` receives the metrics JSON. `policy_impl` / `reward_impl`
    (import paths 'package.module:factory', called with `policy` / `reward_model`) open another
    implementation of core/protocol.py."""
    if out:
        check_out(out, {"--policy": policy, "--policy-ref": policy_ref, "--reward-model": reward_model,
                        "--prompts": prompts, "--gold": gold})
    prompt_records = D.read_jsonl(prompts)
    gold_records = D.read_jsonl(gold, labelled=True, scale=D.EXPERT) if gold else None
    params = {"policy": policy, "policy_ref": policy_ref, "reward_model": reward_model, "prompts": prompts,
              "gold": gold, "n": n, "seed": seed,
              **{k: v for k, v in (("policy_impl", policy_impl), ("reward_impl", reward_impl)) if v}}
    with T.tracked_run("dev_eval", params, run_name=run_name):
        model, model_id = resolve(policy, policy_impl)
        T.log_records_input(prompt_records, prompts, "dev")
        if gold:
            T.log_records_input(gold_records, gold, "gold")
        res = dev_eval(model, open_policy(policy_ref), open_reward_model(reward_model, reward_impl),
                       prompt_records, gold_records, n, seed)
        T.log_metrics(MN.prefixed(MN.DEV, {k: v for k, v in res.metrics.items() if k in CHARTED}), model_id=model_id)
        T.log_table(family_table(res.metrics), FAMILY_TABLE)
        T.log_figure(family_bars(res.metrics, title=f"dev_eval: {policy}"), "figures/dev_eval_families.png")
        T.log_json_artifact(res.metrics, "dev_eval.json")
        if out:
            atomic_write_json(out, res.metrics)
    return res.metrics

