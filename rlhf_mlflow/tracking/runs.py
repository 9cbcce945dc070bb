"""MLflow runs for the pipeline's steps: start, log, and always end (FAILED on any error)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import mlflow

from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.process import note_killed, process_tags, raise_if_interrupted
from rlhf_mlflow.tracking.default_experiment import EXPERIMENT, experiment_id
from rlhf_mlflow.tracking.metric_bounds import checked
from rlhf_mlflow.tracking.metric_logger import flush_async

log = logging.getLogger(__name__)

# A progress bar per tiny artifact download drowns the steps' own output (main downloads dozens); a
# user's own setting wins.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

MAX_PARAM = 6000


def _param_value(v) -> str:
    s = v if isinstance(v, str) else json.dumps(v)
    return s if len(s) <= MAX_PARAM else s[:MAX_PARAM - 3] + "..."


def _ensure_experiment() -> None:
    # under `mlflow run` the run (and so its experiment) is chosen by the launcher
    if not os.environ.get("MLFLOW_RUN_ID") and not mlflow.active_run():
        mlflow.set_experiment(experiment_id=experiment_id(os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)))


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
                nested: bool = False, run_id: str | None = None) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run for one pipeline step; marked KILLED on an interrupt (Ctrl-C, or SIGTERM once
    runtime.handle_signals is on), FAILED on any other error (and re-raised). Inside another step's
    run (the `main` pipeline) it is a child run. `run_id` re-opens an existing run (a resume).
    The run is tagged with this process (host, pid, start time) so that `rlhf-mlflow runs --repair`
    can tell a run whose process is gone from one still going. A run is named `run_name`, or after its
    step."""
    _ensure_experiment()
    launched = os.environ.get("MLFLOW_RUN_ID")  # the launcher's run; start_run unsets the variable
    nested = nested or mlflow.active_run() is not None
    all_tags = {"rlhf.step": step, **environment_tags(), **(tags or {}), **process_tags()}
    if run_id:
        run = mlflow.start_run(run_id=run_id, nested=nested)
        set_tags(all_tags)
    else:
        run = mlflow.start_run(run_name=run_name or step, description=description, nested=nested, tags=all_tags)
    if launched and run.info.run_id == launched:
        _warn_if_default(run)
    try:
        if params:
            log_params(params)
        yield run
        raise_if_interrupted()  # a SIGTERM whose KeyboardInterrupt was swallowed still kills the run
    except KeyboardInterrupt:
        _end("KILLED")
        note_killed(run.info.run_id, step)
        raise
    except BaseException:
        _end("FAILED")
        raise
    _end("FINISHED")


def _end(status: str) -> None:
    """End the active run once every queued metric point is stored."""
    try:
        flush_async()
    finally:
        mlflow.end_run(status=status)


def log_params(params: dict) -> None:
    """Log params, leaving out unset ones (None or '': the UI showed '' for them); a key already logged with
    another value (`mlflow run` logs the raw MLproject values first) is logged as `resolved.<key>`."""
    run = mlflow.active_run()
    existing = mlflow.get_run(run.info.run_id).data.params if run else {}
    out = {}
    for k, v in params.items():
        if v is None or v == "":
            continue
        value = _param_value(v)
        if k not in existing:
            out[k] = value
        elif existing[k] != value:
            out[f"resolved.{k}"] = value
    if out:
        mlflow.log_params(out)


def logged_param(params: dict, key: str):
    """A parameter as the step logged it (log_params: under `mlflow run`, its `resolved.` value)."""
    return params.get(f"resolved.{key}", params.get(key))


MAX_TAG = 5000


def set_tags(tags: dict) -> None:
    """Tags of the active run; long values are cut to what every store accepts."""
    mlflow.set_tags({k: str(v)[:MAX_TAG] for k, v in tags.items()})


def tag_run(run_id: str, tags: dict) -> None:
    """Tags on another (finished) run, e.g. the release decision on the version's training run."""
    c = mlflow.MlflowClient()
    for k, v in tags.items():
        c.set_tag(run_id, k, str(v))


def set_description(text: str) -> None:
    """The active run's description (the markdown the run page shows first)."""
    mlflow.set_tag("mlflow.note.content", text)


def log_metrics(metrics: dict, step: int | None = None, model_id: str | None = None) -> None:
    """Metrics of the active run; a non-finite or absurd value is dropped with a warning (metric_bounds)."""
    mlflow.log_metrics(checked(metrics), step=step, model_id=model_id)


def _local_source(path: str):
    """The dataset source of a local file. MLflow 3.17 registers two local-file source classes (for the
    schemes "" and "file"), so resolving a plain path warns that it is ambiguous; take the first that
    resolves it, which is the one MLflow would pick after warning."""
    from mlflow.data.dataset_source_registry import get_registered_sources
    raw = os.path.abspath(path)
    return next(s for s in get_registered_sources() if s._can_resolve(raw))._resolve(raw)


def log_records_input(records: list[dict], path: str, context: str) -> None:
    """Record the validated records the run read from a JSONL file (data.read_jsonl) as an MLflow
    dataset input (name, digest, source); the file itself is not parsed again."""
    import pandas as pd
    ds = mlflow.data.from_pandas(pd.DataFrame.from_records(records), source=_local_source(path),
                                 name=os.path.basename(path))
    for attempt in range(DATASET_INSERT_TRIES):
        try:
            mlflow.log_input(ds, context=context)
            return
        except mlflow.exceptions.MlflowException as e:
            if attempt == DATASET_INSERT_TRIES - 1 or not _lost_insert_race(e):
                raise
            time.sleep(0.1 * (attempt + 1))


DATASET_INSERT_TRIES = 4
"""MLflow's database stores look a dataset up and insert it if missing in two statements: runs logging
the same file at the same moment (a sweep's trials, main's side-by-side candidates) both insert, and the
second fails on the datasets table's unique key (seen 3 times in 4 with four writers on sqlite). Its retry
finds the row and only links it to the run."""


def _lost_insert_race(e: Exception) -> bool:
    text = str(e)
    return "UNIQUE constraint failed: datasets." in text or (
        "duplicate key value violates unique constraint" in text and "datasets" in text)


def log_json_artifact(obj, name: str, artifact_path: str | None = None) -> str:
    """Log `obj` as a JSON artifact; returns the sha256 of the bytes logged."""
    return log_bytes(json.dumps(obj, indent=1).encode(), name, artifact_path)


def log_bytes(data: bytes, name: str, artifact_path: str | None = None) -> str:
    """Log exactly these bytes as the artifact `name` (e.g. the wrapper source a run executed);
    returns their sha256."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, name)
        with open(path, "wb") as f:
            f.write(data)
        mlflow.log_artifact(path, artifact_path)
    return hashlib.sha256(data).hexdigest()


def log_artifact(path: str, artifact_path: str | None = None) -> None:
    if os.path.isdir(path):
        mlflow.log_artifacts(path, artifact_path)
    else:
        mlflow.log_artifact(path, artifact_path)


KILL_AFTER_UPLOADS = "RLHF_TEST_KILL_AFTER_UPLOADS"  # test-only: SIGKILL before uploading file K+1
_uploaded = [0]


def log_dir_last(path: str, artifact_path: str, last: str) -> None:
    """Upload a directory file by file, its top-level file `last` (a manifest) after all the others."""
    rels = [os.path.relpath(os.path.join(here, n), path) for here, _, names in os.walk(path) for n in names]
    for rel in sorted(r for r in rels if r != last) + ([last] if last in rels else []):
        if _uploaded[0] >= int(os.environ.get(KILL_AFTER_UPLOADS, "-1")) >= 0:
            os.kill(os.getpid(), signal.SIGKILL)
        folder = os.path.dirname(rel).replace(os.sep, "/")
        mlflow.log_artifact(os.path.join(path, rel), f"{artifact_path}/{folder}" if folder else artifact_path)
        _uploaded[0] += 1


def log_figure(fig, name: str) -> None:
    mlflow.log_figure(fig, name)
    import matplotlib.pyplot as plt
    plt.close(fig)


def log_table(frame, name: str) -> None:
    """A pandas frame as an MLflow table artifact (missing values as nulls)."""
    mlflow.log_table(frame.astype(object).where(frame.notna(), None), name)


def log_text(text: str, name: str) -> None:
    mlflow.log_text(text, name)


def log_prompt_files(paths: set[str], context: str = "training") -> None:
    """Log each prompt file as a dataset input of the active run. Before workers start: MLflow inserts a
    dataset row the first time a run of the experiment logs it, without a lock, so workers logging the
    same new file at once collide on its unique key (seen on sqlite); one that exists is only linked."""
    from rlhf_mlflow.core.records import read_jsonl
    for path in sorted(paths):
        log_records_input(read_jsonl(path), path, context)


@contextmanager
def reopened_run(run_id: str) -> Iterator[mlflow.ActiveRun]:
    """Reopen a finished run to add to it; FAILED (and re-raised) if the body raises."""
    run = mlflow.start_run(run_id=run_id)
    try:
        yield run
    except BaseException:
        _end("FAILED")
        raise
    _end("FINISHED")


def get_run(run_id: str):
    """The run, or InputError when the store has no such run."""
    try:
        return mlflow.MlflowClient().get_run(run_id)
    except mlflow.exceptions.MlflowException:
        raise InputError(f"run {run_id} does not exist in {mlflow.get_tracking_uri()}") from None


def use_experiment_of(run) -> None:
    """Make the run's own experiment the active one (to re-open the run, whatever the environment says)."""
    mlflow.set_experiment(experiment_id=run.info.experiment_id)


def list_artifact_names(run_id: str, path: str) -> list[str]:
    """Base names of the artifacts directly under `path` of a run ([] when there are none)."""
    try:
        return [os.path.basename(a.path) for a in mlflow.MlflowClient().list_artifacts(run_id, path)]
    except mlflow.exceptions.MlflowException:
        return []


def download_artifact(run_id: str, path: str, dst: str) -> str | None:
    """A run's artifact (file or directory) downloaded under dst; None when the run has no such artifact."""
    try:
        return mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path, dst_path=dst)
    except (mlflow.exceptions.MlflowException, OSError):
        return None


def search_runs(filter_string: str = "", experiment_names: list[str] | None = None):
    """All runs (every experiment unless named) as a pandas frame, newest first."""
    if experiment_names:
        return mlflow.search_runs(experiment_names=experiment_names, filter_string=filter_string)
    return mlflow.search_runs(search_all_experiments=True, filter_string=filter_string)
