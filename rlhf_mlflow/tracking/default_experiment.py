"""MLflow's default experiment inside an rlhf_mlflow checkout is `rlhf_mlflow`, not `Default`.

`mlflow run .` creates its run in the launching process before any entry point starts, in the
experiment of `--experiment-name`, else MLFLOW_EXPERIMENT_NAME / MLFLOW_EXPERIMENT_ID, else the first
registered default-experiment provider that is in context, else `Default`. This provider (registered
in pyproject.toml under MLflow's `mlflow.default_experiment_provider` plugin group) is in context when
the current directory or one above it holds this project's MLproject, so `mlflow run .` and every
other MLflow client started there without an experiment use the same experiment as `rlhf-mlflow`.

MLflow loads this plugin while `import mlflow` is still running (its default-experiment registry
loads the plugin group when `mlflow.tracking.fluent` is first imported). So this module imports
nothing from mlflow at module level, not even the provider's base class: were it the first to import
mlflow (`from rlhf_mlflow.tracking import history` in a fresh interpreter), MLflow would find it
half-initialised in sys.modules, without `ProjectExperimentProvider` yet ("most likely due to a
circular import"), warn, and leave the provider out of that process. MLflow only instantiates the
class and calls its two methods; its base class `DefaultExperimentProvider` declares them and
enforces nothing (tests/test_readme_snippets.py imports this project before mlflow in a fresh
interpreter).
"""
from __future__ import annotations

import os

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


class ProjectExperimentProvider:
    """`rlhf_mlflow` is the default experiment in an rlhf_mlflow checkout (MLflow's
    `DefaultExperimentProvider` interface: `in_context`, `get_experiment_id`)."""

    def in_context(self) -> bool:
        return project_root() is not None

    def get_experiment_id(self) -> str:
        return experiment_id()
