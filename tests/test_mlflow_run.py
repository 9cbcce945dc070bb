"""`mlflow run .` as users type it: the environment MLflow makes from python_env.yaml, the experiment."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import entry_points

import mlflow
import pytest
import tomllib
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
    mlflow.set_experiment(experiment_id=exp_id)  # this process's experiment is the launcher's, not an earlier test's
    with caplog.at_level(logging.WARNING), T.tracked_run("probe") as run:
        assert run.info.run_id == launched.info.run_id
    warned = "this run is in MLflow's Default experiment" in caplog.text
    assert warned == (experiment == "Default")
    tags = mlflow.get_run(run.info.run_id).data.tags
    import torch
    assert tags["rlhf.torch"] == torch.__version__
    assert tags["rlhf.torch_cuda"] == (torch.version.cuda or "none")


def _mlflow_run(args, cwd, env):
    t0 = time.monotonic()
    out = subprocess.run(["mlflow", "run", ".", *args], cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return seconds, log


def _du_mb(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if not os.path.islink(os.path.join(d, f))) / 2 ** 20


@pytest.mark.slow
def test_mlflow_run_as_typed_on_a_fresh_clone(tmp_path, tiny_world, tracking_uri):
    """The issue's command on a fresh clone, no conda on PATH, `make run`'s venv first on PATH: MLflow
    builds the run's environment from python_env.yaml once and reuses it; runs land in rlhf_mlflow."""
    venv_bin = os.path.dirname(sys.executable)  # the venv running the tests (`make run` / `make test`'s)
    assert any(e.name == "rlhf_mlflow" for e in entry_points(group="mlflow.default_experiment_provider")), \
        "this venv predates pyproject.toml's MLflow plugin: reinstall it (make .venv/.installed)"
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", ROOT, str(clone)], check=True)
    path = [p for p in os.environ["PATH"].split(os.pathsep)
            if p and "conda" not in p and not os.path.exists(os.path.join(p, "conda"))]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")}
    env_root = tmp_path / "envs"  # MLflow's environment cache, private so the first run builds it
    env.update(PATH=os.pathsep.join([venv_bin, *path]), MLFLOW_TRACKING_URI=tracking_uri,
               MLFLOW_ENV_ROOT=str(env_root))
    assert shutil.which("conda", path=env["PATH"]) is None
    args = ["-e", "train_rl", "-P", "kl_coef=0.05", "-P", "steps=20", "-P", f"world={tiny_world}"]
    try:
        first, log1 = _mlflow_run(args, clone, env)
        second, log2 = _mlflow_run(args, clone, env)
        local, _ = _mlflow_run([*args, "--env-manager", "local"], clone, env)
        (made,) = os.listdir(env_root)
        assert "Creating a new environment" in log1 and f"Environment {env_root / made} already exists" in log2
        probe = subprocess.run([str(env_root / made / "bin" / "python"), "-c",
                                "import torch; print(torch.__version__, torch.version.cuda)"],
                               capture_output=True, text=True, check=True).stdout.split()
        size_mb = _du_mb(env_root / made)
    finally:
        shutil.rmtree(env_root, ignore_errors=True)  # ~2 GB
    print(f"\nmlflow run (virtualenv): first {first:.0f} s, second {second:.0f} s; "
          f"--env-manager local {local:.0f} s; environment {size_mb:.0f} MB")
    assert probe == ["2.13.0+cpu", "None"], probe
    assert second < first

    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("rlhf_mlflow")
    runs = client.search_runs([exp.experiment_id], "tags.`rlhf.step` = 'train_rl'", order_by=["start_time ASC"])
    assert len(runs) == 3
    assert client.search_runs(["0"]) == []  # nothing in Default
    for run, manager in zip(runs, ["virtualenv", "virtualenv", None]):
        assert run.info.status == "FINISHED"
        assert run.data.tags.get("mlflow.project.env") == manager
        assert run.data.tags["rlhf.torch_cuda"] == "none"
        assert run.data.params["kl_coef"] == "0.05" and run.data.params["steps"] == "20"
    versions = client.search_model_versions("name = 'rlhf-policy'")
    assert sorted(v.run_id for v in versions) == sorted(r.info.run_id for r in runs)
