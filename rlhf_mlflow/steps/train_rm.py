"""The `train_rm` step: train a reward model on labelled records (MSE) as an MLflow run, with its
loss curve, per-family fit to the labels (and to the expert set when given) and the checkpoint."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from rlhf_mlflow.core import files as F
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.steps.outputs import check_out_dir
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.metric_logger import MetricLogger
from rlhf_mlflow.training.train_rm import RMConfig, per_family_fit, train_rm


def run_train_rm(data: str, out: str, cfg: RMConfig, gold: str | None = None,
                 echo: Callable[[str], None] = print, overwrite: bool = False) -> dict:
    """Train, save to `out` (whole, marked as this run's: the one output rule, outputs.py; `overwrite`
    replaces another train_rm run's), log; returns the per-family fit on the training records."""
    check_out_dir(out, "train_rm", {"--data": data, "--gold": gold}, overwrite=overwrite)
    records = D.read_jsonl(data, labelled=True, scale=D.CROWD)  # crowd or expert: the wider range
    gold_recs = D.read_jsonl(gold, labelled=True, scale=D.EXPERT) if gold else None
    with T.tracked_run("train_rm", {**asdict(cfg), "data": data, "gold": gold}) as run:
        T.log_records_input(records, data, "training")
        logger = MetricLogger()

        def on_log(epoch, m):
            logger(epoch, MN.prefixed(MN.RM, m))
            echo(f"epoch {epoch}: loss {m['loss']:.4f}")

        rm, info = train_rm(records, cfg, on_log=on_log)
        logger.flush()
        with F.atomic_dir(out, F.Owner("train_rm", run.info.run_id)) as staging:
            R.save_rm(rm, info["config"], staging)
        metrics = {f"label_pearson/{f}": v["pearson"] for f, v in info["fit"].items()}
        if gold_recs:
            scores = R.score(rm, D.prompts_tensor(gold_recs), D.responses_tensor(gold_recs))
            fit = per_family_fit(scores, D.labels_tensor(gold_recs), D.family_index(gold_recs))
            metrics.update({f"gold_pearson/{f}": v["pearson"] for f, v in fit.items()})
        T.log_metrics(MN.prefixed(MN.RM, metrics))
        T.log_artifact(out, "reward_model")
    return info["fit"]
