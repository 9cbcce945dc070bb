"""Worker processes (a Ray trial, one of `main`'s trainers) that log to their parent's store and
experiment: what a worker needs to know, and how it sets itself up."""
from __future__ import annotations

import os

import mlflow

from rlhf_mlflow.core.process import configure_threads, handle_signals


def absolute_tracking_uri() -> str:
    """The active tracking URI with a relative sqlite or file path made absolute."""
    uri = mlflow.get_tracking_uri()
    for prefix in ("sqlite:///", "file://"):
        if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
            return prefix + os.path.abspath(uri[len(prefix):])
    if "://" not in uri:
        return os.path.abspath(uri)
    return uri


def is_local_store(uri: str) -> bool:
    return uri.startswith(("sqlite:", "file:", "/")) or "://" not in uri


def experiment_of(run_id: str) -> str:
    """The name of the run's experiment."""
    return mlflow.get_experiment(mlflow.get_run(run_id).info.experiment_id).name


def enter_worker(tracking_uri: str, experiment_name: str, threads: int) -> None:
    """Point this worker process at a store and experiment, never at a launcher's run (`mlflow run`
    exports MLFLOW_RUN_ID), with `threads` torch threads; SIGTERM ends its run KILLED."""
    handle_signals()
    os.environ.pop("MLFLOW_RUN_ID", None)
    os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    os.environ["MLFLOW_EXPERIMENT_NAME"] = experiment_name
    os.environ["RLHF_THREADS"] = str(threads)
    mlflow.set_tracking_uri(tracking_uri)
    while mlflow.active_run():
        mlflow.end_run()
    configure_threads()
