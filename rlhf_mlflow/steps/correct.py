"""The `correct` step: write the reward wrapper that subtracts what the reward model pays for each of
the diagnostic's flagged shortcuts (the QA labels' slope reported beside it), as an MLflow run."""
from __future__ import annotations

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.shortcut_rules import read_diagnostic
from rlhf_mlflow.decisions.correction import fit_corrections, write_wrapper
from rlhf_mlflow.steps.outputs import check_out
from rlhf_mlflow.tracking import runs as T


def run_correction(diagnostic: str | dict, qa: str, out: str, run_name: str = "correction") -> list[dict]:
    """Corrections for the flagged shortcuts (what the model pays; the QA sample's label slopes beside
    them); write and log the reward wrapper (as the run `run_name`)."""
    check_out(out, {"--diagnostic": diagnostic if isinstance(diagnostic, str) else None, "--qa": qa})
    result = read_diagnostic(diagnostic) if isinstance(diagnostic, str) else diagnostic  # before the run
    qa_records = D.read_jsonl(qa, labelled=True, scale=D.CROWD)
    params = {"diagnostic": diagnostic if isinstance(diagnostic, str) else "(in memory)", "qa": qa}
    with T.tracked_run("correction", params, run_name=run_name):
        rules = fit_corrections(result, qa_records)
        sha256 = write_wrapper(rules, out)
        T.log_params({"reward_wrapper_sha256": sha256})
        T.log_artifact(out, "reward_wrapper")
        T.log_json_artifact(rules, "corrections.json")
    return rules

