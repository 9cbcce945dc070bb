"""The run `mlflow run` creates for an entry point before the entry point starts (MLFLOW_RUN_ID in
its environment): named after its step at once, so that a run which fails on its arguments, before
the step opens it (tracking/runs.py: tracked_run names it again, after its recipe or step), is not
left with MLflow's random name (`amusing-donkey-465`)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

RUN_NAME_TAG = "mlflow.runName"


def name_launched_run(step: str) -> None:
    """Name the launcher's run `step`; nothing outside `mlflow run`. A store that refuses is a warning:
    the step itself decides whether the run can go on."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return
    import mlflow
    try:
        mlflow.MlflowClient().set_tag(run_id, RUN_NAME_TAG, step)
    except mlflow.exceptions.MlflowException as e:
        log.warning("warning: could not name the launched run %s %r: %s", run_id, step, e)
