"""MLflow's default experiment inside an rlhf_mlflow checkout is `rlhf_mlflow`, not `Default`.

`mlflow run .` creates its run in the launching process before any entry point starts, in the
experiment of `--experiment-name`, else MLFLOW_EXPERIMENT_NAME / MLFLOW_EXPERIMENT_ID, else the first
registered default-experiment provider that is in context, else `Default`. This provider (registered
in pyproject.toml under MLflow's `mlflow.default_experiment_provider` plugin group) is in context when
the current directory or one above it holds this project's MLproject, so `mlflow run .` and every
other MLflow client started there without an experiment use the same experiment as `rlhf-mlflow`.

Loaded while `import mlflow` is still running: it imports nothing from mlflow at module level
beyond the provider's base class, and reads the MLproject only when asked.
"""
from __future__ import annotations

import os

from mlflow.tracking.default_experiment.abstract_context import (
    DefaultExperimentProvider,
)

EXPERIMENT = "rlhf_mlflow"
PROJECT_NAME = "rlhf_mlflow"


def project_root(start: str | None = None) -> str | None:
    """The nearest directory at or above `start` (default: cwd) whose MLproject names this project."""
    import yaml
    path = os.path.abspath(start or os.getcwd())
    while True:
        mlproject = os.path.join(path, "MLproject")
        if os.path.isfile(mlproject):
            try:
                with open(mlproject) as f:
                    if (yaml.safe_load(f) or {}).get("name") == PROJECT_NAME:
                        return path
            except (OSError, yaml.YAMLError):
                pass
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def experiment_id(name: str = EXPERIMENT) -> str:
    """The id of experiment `name`, created if missing (another process may create it first), of the
    kind that MLflow's UI opens on its runs (tracking/experiment_view.py)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from rlhf_mlflow.tracking.experiment_view import KIND, KIND_TAG
    client = MlflowClient()
    if exp := client.get_experiment_by_name(name):
        return exp.experiment_id
    try:
        return client.create_experiment(name, tags={KIND_TAG: KIND})
    except MlflowException:
        if exp := client.get_experiment_by_name(name):
            return exp.experiment_id
        raise


class ProjectExperimentProvider(DefaultExperimentProvider):
    """`rlhf_mlflow` is the default experiment in an rlhf_mlflow checkout."""

    def in_context(self) -> bool:
        return project_root() is not None

    def get_experiment_id(self) -> str:
        return experiment_id()
