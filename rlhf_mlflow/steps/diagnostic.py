"""The `diagnostic` step: the gold-free reward-shortcut audit as an MLflow run (risk/<family>,
flag/<family>, the evidence JSON and a figure)."""
from __future__ import annotations

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.files import atomic_write_json
from rlhf_mlflow.evidence.diagnostic import run_diagnostic
from rlhf_mlflow.steps.figures import diagnostic_bars
from rlhf_mlflow.steps.outputs import check_out
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import runs as T


def run_diagnostic_step(rm_dir: str, policy_dir: str, prompts: str, n_prompts: int = 48, seed: int = 0,
                        out: str | None = None, gold: str | None = None, policy_impl: str | None = None,
                        reward_impl: str | None = None) -> dict:
    """The gold-free shortcut audit; logs risk/<family>, flag/<family>, the evidence and a figure.
    `out` receives the result JSON; `gold` (optional) is an expert set that credits correctness;
    `policy_impl` / `reward_impl` open another implementation of core/protocol.py (evidence/diagnostic.py)."""
    if out:
        check_out(out, {"--rm-dir": rm_dir, "--policy-dir": policy_dir, "--prompts": prompts, "--gold": gold})
    if gold:  # before the run (run_diagnostic reads it again)
        D.read_jsonl(gold, labelled=True, scale=D.EXPERT)
    params = {"rm_dir": rm_dir, "policy_dir": policy_dir, "prompts": prompts, "n_prompts": n_prompts, "seed": seed,
              "gold": gold or "", **{k: v for k, v in (("policy_impl", policy_impl), ("reward_impl", reward_impl)) if v}}
    with T.tracked_run("diagnostic", params, run_name="diagnostic"):
        result = run_diagnostic(rm_dir, policy_dir, prompts, n_prompts, seed, gold_path=gold, policy_impl=policy_impl,
                                reward_impl=reward_impl)
        fams = result["families"]
        T.log_metrics(MN.prefixed(MN.DIAGNOSTIC, {**{f"risk/{f}": v["risk"] for f, v in fams.items()},
                                                   **{f"flag/{f}": float(v["flag"]) for f, v in fams.items()}}))
        T.log_json_artifact(result, "diagnostic.json")
        T.log_figure(diagnostic_bars(result), "figures/diagnostic.png")
        if out:
            atomic_write_json(out, result)
    return result

