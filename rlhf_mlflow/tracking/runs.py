"""MLflow runs for the pipeline's steps: start, log, and always end (FAILED on any error)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import mlflow

from .default_experiment import EXPERIMENT

log = logging.getLogger(__name__)

# A progress bar per tiny artifact download and a warning per logged dataset input drown the steps'
# own output (main downloads dozens); a user's own setting wins.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways",
                        category=UserWarning)

MAX_PARAM = 6000


def _param_value(v) -> str:
    s = v if isinstance(v, str) else json.dumps(v)
    return s if len(s) <= MAX_PARAM else s[:MAX_PARAM - 3] + "..."


def _ensure_experiment() -> None:
    # under `mlflow run` the run (and so its experiment) is chosen by the launcher
    if not os.environ.get("MLFLOW_RUN_ID") and not mlflow.active_run():
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT))


def _warn_if_default(run: mlflow.ActiveRun) -> None:
    # `mlflow run` started outside a checkout, or by an `mlflow` whose environment lacks this package
    # (so without its default-experiment provider), puts its run in MLflow's Default experiment
    if os.environ.get("MLFLOW_EXPERIMENT_NAME") == "Default":
        return
    if mlflow.get_experiment(run.info.experiment_id).name == "Default":
        log.warning("warning: this run is in MLflow's Default experiment, not %s: pass `--experiment-name %s` "
                    "to `mlflow run` (or set MLFLOW_EXPERIMENT_NAME=%s)", EXPERIMENT, EXPERIMENT, EXPERIMENT)


def environment_tags() -> dict:
    """The torch build the step runs on (`rlhf.torch_cuda` is `none` for the CPU build)."""
    import torch
    return {"rlhf.torch": torch.__version__, "rlhf.torch_cuda": torch.version.cuda or "none"}


@contextmanager
def tracked_run(step: str, params: dict | None = None, tags: dict | None = None,
                description: str | None = None, run_name: str | None = None,
                nested: bool = False) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run for one pipeline step; marked FAILED (and re-raised) if the body raises. Inside
    another step's run (the `main` pipeline) it is a child run."""
    _ensure_experiment()
    launched = os.environ.get("MLFLOW_RUN_ID")  # the launcher's run; start_run unsets the variable
    nested = nested or mlflow.active_run() is not None
    run = mlflow.start_run(run_name=run_name, description=description, nested=nested,
                           tags={"rlhf.step": step, **environment_tags(), **(tags or {})})
    if launched and run.info.run_id == launched:
        _warn_if_default(run)
    try:
        if params:
            log_params(params)
        yield run
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    mlflow.end_run(status="FINISHED")


def log_params(params: dict) -> None:
    """Log params; a key already logged with another value (under `mlflow run` the launcher logs the
    raw MLproject values first) is logged resolved as `resolved.<key>` instead of failing."""
    run = mlflow.active_run()
    existing = mlflow.get_run(run.info.run_id).data.params if run else {}
    out = {}
    for k, v in params.items():
        if v is None:
            continue
        value = _param_value(v)
        if k not in existing:
            out[k] = value
        elif existing[k] != value:
            out[f"resolved.{k}"] = value
    if out:
        mlflow.log_params(out)


class MetricLogger:
    """An `on_log(step, metrics)` callback that buffers metric points and hands them to MLflow's
    asynchronous logger in one batch at most every `flush_seconds` (and on `flush()`), so the
    training loop neither waits on the store (~20 ms a synchronous call on sqlite) nor pays a
    store round trip per report."""

    def __init__(self, prefix: str = "", flush_seconds: float = 10.0):
        self.prefix = prefix
        self.flush_seconds = flush_seconds
        self._last = time.monotonic()
        self._buffer: list = []

    def __call__(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric
        ts = int(1000 * time.time())
        self._buffer += [Metric(self.prefix + k, float(v), ts, step) for k, v in metrics.items()]
        if time.monotonic() - self._last >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            run = mlflow.active_run()
            mlflow.MlflowClient().log_batch(run.info.run_id, metrics=self._buffer, synchronous=False)
            self._buffer = []
        self._last = time.monotonic()


def set_tags(tags: dict) -> None:
    mlflow.set_tags({k: str(v) for k, v in tags.items()})


def log_metrics(metrics: dict, step: int | None = None, model_id: str | None = None) -> None:
    mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step, model_id=model_id)


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def log_jsonl_input(path: str, context: str) -> None:
    """Record a JSONL file the run read as an MLflow dataset input (name, digest, source)."""
    import pandas as pd
    df = pd.read_json(path, lines=True)
    ds = mlflow.data.from_pandas(df, source=os.path.abspath(path), name=os.path.basename(path))
    mlflow.log_input(ds, context=context)


def log_json_artifact(obj, name: str, artifact_path: str | None = None) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, name)
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
        mlflow.log_artifact(path, artifact_path)


def log_artifact(path: str, artifact_path: str | None = None) -> None:
    if os.path.isdir(path):
        mlflow.log_artifacts(path, artifact_path)
    else:
        mlflow.log_artifact(path, artifact_path)


def log_figure(fig, name: str) -> None:
    mlflow.log_figure(fig, name)
    import matplotlib.pyplot as plt
    plt.close(fig)


def log_text(text: str, name: str) -> None:
    mlflow.log_text(text, name)


def search_runs(filter_string: str = "", experiment_names: list[str] | None = None):
    """All runs (every experiment unless named) as a pandas frame, newest first."""
    if experiment_names:
        return mlflow.search_runs(experiment_names=experiment_names, filter_string=filter_string)
    return mlflow.search_runs(search_all_experiments=True, filter_string=filter_string)
