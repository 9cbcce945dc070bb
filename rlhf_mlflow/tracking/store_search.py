"""Searching the whole store for a record: every experiment, deleted ones too, and deleted runs too.

MLflow's `search_all_experiments=True` searches the active experiments only, so a run in an experiment
deleted afterwards would drop out of a search that must see every record (which look a version's
labels are, the first record of a world); deleting an experiment or a run must hide nothing."""
from __future__ import annotations

import mlflow
from mlflow.entities import ViewType


def every_run(filter_string: str) -> list:
    """Runs matching `filter_string` in every experiment and lifecycle stage, oldest first."""
    ids = [e.experiment_id for e in mlflow.search_experiments(view_type=ViewType.ALL)]
    if not ids:
        return []
    return mlflow.search_runs(ids, filter_string, run_view_type=ViewType.ALL, output_format="list",
                              order_by=["attributes.start_time ASC"])
