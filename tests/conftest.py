"""Shared fixtures: a tiny world built once per test session, and a tracking URI under tmp_path."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator
import shutil
import tempfile

import pytest
import torch

from rlhf_mlflow.core.process import QUIET_ENV
from rlhf_mlflow.world.build import build_world

torch.set_num_threads(int(os.environ.get("RLHF_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> str:
    """A test-scale world with the default corruptions (dune pa +1.45, ember he +0.47). With
    RLHF_TEST_WORLD set, a copy of that prebuilt world (`build-world --scale test --out DIR`) instead:
    saves the build when iterating on a few tests."""
    path = str(tmp_path_factory.mktemp("worlds") / "default")
    prebuilt = os.environ.get("RLHF_TEST_WORLD")
    if prebuilt:
        shutil.copytree(prebuilt, path)
    else:
        build_world(path, seed=0, spec=None, scale="test")
    return path


@pytest.fixture(autouse=True)
def tracking_uri(tmp_path, monkeypatch) -> str:
    """Every test gets its own real sqlite tracking store (and artifact root) under tmp_path."""
    import mlflow
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv(QUIET_ENV, "")  # `rlhf-mlflow -q` in one CliRunner test sets it for the process: undone here
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root ./mlruns lands in tmp_path too
    mlflow.set_tracking_uri(uri)
    yield uri
    while mlflow.active_run():
        mlflow.end_run()


@pytest.fixture(scope="session")
def pg_server():
    """PostgreSQL + `mlflow server --workers 1` on free loopback ports, under a fresh directory."""
    from rlhf_mlflow.tracking.server import ServerConfig, TrackingServer
    # as root, PostgreSQL runs as the `postgres` user, which must be able to reach its data directory
    root = tempfile.mkdtemp(prefix="rlhf-server-")
    os.chmod(root, 0o755)
    server = TrackingServer(ServerConfig(root=os.path.join(root, "server"), port=0))
    server.start()
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


def store_made_once(tmp_path_factory, name: str, build):
    """(directory, build(directory)) with `build` run against a fresh sqlite store in that directory:
    for a module whose tests each start from the same registered, certified versions (copy_store)."""
    import mlflow
    root = tmp_path_factory.mktemp(name)
    uri = f"sqlite:///{root}/mlflow.db"
    cwd, prior = os.getcwd(), mlflow.get_tracking_uri()
    os.chdir(root)
    mlflow.set_tracking_uri(uri)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLFLOW_TRACKING_URI", uri)
            return root, build(root)
    finally:
        os.chdir(cwd)
        mlflow.set_tracking_uri(prior)


def copy_store(root, tmp_path) -> None:
    """The test's own copy of a store_made_once store (its artifacts stay where the module made them)."""
    shutil.copy(root / "mlflow.db", tmp_path / "mlflow.db")


@pytest.fixture(scope="session")
def story_store(tiny_world, tmp_path_factory):
    """A store holding one small `main` (made once per session: test_story.py, test_ui_browser.py)."""
    from click.testing import CliRunner

    from rlhf_mlflow.cli import cli

    def run_main(root):
        # the test-scale world is too small for RL to gain 0.03 anywhere: a gain of any size is let
        # through, so that the story has a champion and refused versions
        # one round: a repair round costs the suite minutes (tests/test_rounds.py runs one, marked slow)
        res = CliRunner().invoke(cli, ["main", "--world", tiny_world, "--steps-scale", "0.1", "--out", str(root / "out"),
                                       "--rounds", "1", "--guardrail", "min_balanced_gain=-1", "--guardrail",
                                       "require_significant_gain=false"])
        assert res.exit_code == 0, res.output
        return res.output
    return store_made_once(tmp_path_factory, "story", run_main)


@pytest.fixture
def story(story_store, tmp_path, tracking_uri) -> str:
    root, output = story_store
    copy_store(root, tmp_path)
    return output


@contextmanager
def rlhf_ui_server(store_uri: str, cwd) -> Iterator[str]:
    """`mlflow server --app-name rlhf` on `store_uri`, on a free loopback port; yields its URL."""
    from rlhf_mlflow.tracking.ui_app import served
    server = served(store_uri, cwd)
    try:
        url = server.__enter__()
    except RuntimeError as e:  # the server's failure, not the test's
        pytest.fail(str(e))
    try:
        yield url
    finally:
        server.__exit__(None, None, None)
