"""`mlflow run .` as users type it: the environment MLflow makes from python_env.yaml, the experiment."""
from __future__ import annotations

import logging
import os
import shutil
import tomllib

import mlflow
import pytest
import yaml

from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.default_experiment import ProjectExperimentProvider

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _yaml(name):
    with open(os.path.join(ROOT, name)) as f:
        return yaml.safe_load(f)


def _project_dependencies():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def test_mlproject_environment_is_python_env_with_the_project_dependencies():
    assert _yaml("MLproject")["python_env"] == "python_env.yaml"
    assert "conda_env" not in _yaml("MLproject")
    env = _yaml("python_env.yaml")
    assert env["dependencies"] == _project_dependencies()
    # no `python:` key: MLflow asks pyenv for the launching interpreter's version, which it has
    assert set(env) == {"dependencies"}


def test_conda_yaml_installs_this_checkout_with_the_same_torch():
    deps = _yaml("conda.yaml")["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    torch_pin = next(d for d in _project_dependencies() if d.startswith("torch"))
    assert "python=3.11" in deps and torch_pin in pip and "-e ." in pip


def test_default_experiment_is_rlhf_mlflow_inside_a_checkout_only(tmp_path, monkeypatch):
    checkout, other = tmp_path / "checkout", tmp_path / "other"
    (checkout / "notebooks").mkdir(parents=True)
    other.mkdir()
    shutil.copy(os.path.join(ROOT, "MLproject"), checkout / "MLproject")
    (other / "MLproject").write_text("name: other\n")
    provider = ProjectExperimentProvider()
    monkeypatch.chdir(checkout / "notebooks")
    assert provider.in_context()
    exp_id = provider.get_experiment_id()
    assert mlflow.get_experiment(exp_id).name == "rlhf_mlflow" and provider.get_experiment_id() == exp_id
    monkeypatch.chdir(other)
    assert not provider.in_context()
    monkeypatch.chdir(tmp_path)
    assert not provider.in_context()


@pytest.mark.parametrize("experiment", ["Default", "rlhf_mlflow"])
def test_a_launched_run_in_default_warns_and_records_torch(experiment, caplog, monkeypatch):
    # what `mlflow run` does: create the run, then start the entry point with MLFLOW_RUN_ID
    exp = mlflow.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else mlflow.create_experiment(experiment)
    launched = mlflow.MlflowClient().create_run(exp_id)
    monkeypatch.setenv("MLFLOW_RUN_ID", launched.info.run_id)
    with caplog.at_level(logging.WARNING), T.tracked_run("probe") as run:
        assert run.info.run_id == launched.info.run_id
    warned = "this run is in MLflow's Default experiment" in caplog.text
    assert warned == (experiment == "Default")
    tags = mlflow.get_run(run.info.run_id).data.tags
    import torch
    assert tags["rlhf.torch"] == torch.__version__
    assert tags["rlhf.torch_cuda"] == (torch.version.cuda or "none")
