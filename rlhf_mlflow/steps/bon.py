"""The `bon` step: best-of-N selection against a reward model as an MLflow run (the chosen samples
as an artifact, per-family proxy of the chosen and of a plain sample)."""
from __future__ import annotations

import os
import tempfile

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core.files import check_writable
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.policy_model import resolve_policy
from rlhf_mlflow.training.bon import best_of_n


def run_bon(policy: str, reward_model: str, prompts: str, n: int = 32, limit: int | None = None, seed: int = 0,
            out: str | None = None) -> dict:
    """Best-of-n on the first `limit` prompts; returns the metrics. `out` receives the samples (JSONL)."""
    if out:
        check_writable(out)
    records = D.read_jsonl(prompts)
    params = {"policy": policy, "reward_model": reward_model, "prompts": prompts, "n": n, "limit": limit,
              "seed": seed}
    with T.tracked_run("bon", params), tempfile.TemporaryDirectory() as tmp:
        policy_dir, model_id = resolve_policy(policy)
        T.log_records_input(records, prompts, "prompts")
        samples, metrics = best_of_n(M.load_policy(policy_dir)[0], R.load_rm(reward_model)[0], records[:limit], n,
                                     seed=seed)
        path = out or os.path.join(tmp, "samples.jsonl")
        D.write_jsonl(path, samples)
        T.log_artifact(path, "samples")
        T.log_metrics(MN.prefixed(MN.BON, metrics), model_id=model_id)
    return metrics
