"""A checkpoint in the artifact store is whole or it is not used: each carries a MANIFEST.json (every
file's path, size and sha256) uploaded after its files; `train-rl --resume` takes the newest checkpoint
whose downloaded files match its manifest and whose training state fits the run's config, and says
which newer ones it skipped and why. SIGKILLed at any point of its checkpoint uploads (a test-only hook
kills the real process after exactly K files), a run resumes to FINISHED with every metric point; a run
started with --no-register stays unregistered; `checkpoints/final` holds the final policy only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from urllib.parse import unquote, urlparse

import mlflow
import pytest
from click.testing import CliRunner
from conftest import copy_store, store_made_once

from rlhf_mlflow.cli import cli
from rlhf_mlflow.core import checkpoint as CK
from rlhf_mlflow.tracking.runs import KILL_AFTER_UPLOADS
from rlhf_mlflow.training.train_state import TrainState, resume_problem

RLHF_MLFLOW = os.path.join(os.path.dirname(sys.executable), "rlhf-mlflow")
STEP_FILES = ["MANIFEST.json", "config.json", "policy.safetensors", "train_state.json", "train_state.safetensors"]
FINAL_FILES = ["MANIFEST.json", "config.json", "policy.safetensors"]


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    """A store with MLflow's tables made once: creating them costs each test seconds of CPU."""
    return store_made_once(tmp_path_factory, "empty_store", lambda root: mlflow.MlflowClient().search_experiments())[0]


@pytest.fixture(autouse=True)
def _tables_made(empty_store, tmp_path, tracking_uri):
    copy_store(empty_store, tmp_path)


def _args(world: str, steps: int, *extra: str) -> list[str]:
    return ["train-rl", "--world", world, "--steps", str(steps), "--save-every", "2", "--log-every", "1",
            "--batch-prompts", "4", "--samples-per-prompt", "2", "--no-register", *extra]


def _train(world: str, steps: int, *extra: str) -> str:
    """A finished --no-register run, in this process; its run id."""
    res = CliRunner().invoke(cli, _args(world, steps, *extra))
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["run_id"]


def _artifacts(run_id: str) -> str:
    """The run's artifact directory (the local store the tests use)."""
    return unquote(urlparse(mlflow.get_run(run_id).info.artifact_uri).path)


def _names(run_id: str, path: str) -> list[str]:
    return sorted(os.path.basename(a.path) for a in mlflow.MlflowClient().list_artifacts(run_id, path))


def _resume(run_id: str):
    """`train-rl --resume` without --no-register: the run's own choice must hold."""
    res = CliRunner().invoke(cli, ["train-rl", "--resume", run_id])
    assert res.exit_code == 0, res.output
    return res


def _assert_finished_whole(run_id: str, steps: int, start: int) -> None:
    run = mlflow.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["rlhf.resumed_from_step"] == str(start)
    client = mlflow.MlflowClient()
    for key in ("train/stats/loss", "train/proxy/balanced", "train/kl/balanced"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(1, steps + 1)), key
    assert _names(run_id, "checkpoints/final") == FINAL_FILES
    assert CK.verify_manifest(client.download_artifacts(run_id, "checkpoints/final")) is None
    assert run.data.tags["rlhf.register"] == "false" and "rlhf.registered_step" not in run.data.tags
    assert not client.search_model_versions("name = 'rlhf-policy'")


def test_manifest_lists_every_file_and_says_what_a_copy_lacks(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "watch_best").mkdir(parents=True)
    (ckpt / "config.json").write_text('{"d_model": 8}')
    (ckpt / "watch_best" / "policy.safetensors").write_bytes(b"\x01" * 100)
    CK.write_manifest(str(ckpt))
    files = json.loads((ckpt / CK.MANIFEST).read_text())["files"]
    assert sorted(files) == ["config.json", "watch_best/policy.safetensors"]
    assert files["config.json"]["size"] == 14
    assert CK.verify_manifest(str(ckpt)) is None
    (ckpt / "extra.txt").write_text("not listed: ignored")
    assert CK.verify_manifest(str(ckpt)) is None
    (ckpt / "config.json").write_text("")
    assert CK.verify_manifest(str(ckpt)) == "config.json: 0 bytes, manifest says 14"
    (ckpt / "config.json").write_text('{"d_model": 9}')
    assert CK.verify_manifest(str(ckpt)) == "config.json: sha256 differs from the manifest's"
    (ckpt / "watch_best" / "policy.safetensors").unlink()
    assert "watch_best/policy.safetensors: missing" in CK.verify_manifest(str(ckpt))
    (ckpt / CK.MANIFEST).write_text('{"files": {"../../etc/passwd": {"size": 1, "sha256": "x"}}}')
    assert CK.verify_manifest(str(ckpt)) == "../../etc/passwd: outside the checkpoint"
    (ckpt / CK.MANIFEST).write_text('{"files": ')
    assert CK.verify_manifest(str(ckpt)) == "MANIFEST.json unreadable (JSONDecodeError)"
    (ckpt / CK.MANIFEST).unlink()
    assert CK.verify_manifest(str(ckpt)) == "no MANIFEST.json"


def test_a_training_state_the_run_could_not_have_saved_is_refused():
    history = [[1, {}], [2, {}]]
    assert resume_problem(TrainState(2, meta={"history": history}), 2, steps=6, save_every=2) is None
    for step, named, why in [(100000, 2, "outside the run's 1..5 (steps 6)"), (-1, 2, "outside the run's 1..5"),
                             (6, 6, "outside the run's 1..5"), (4, 2, "at step 4, not 2"),
                             (3, 3, "not a multiple of the run's save_every (2)")]:
        assert why in resume_problem(TrainState(step, meta={"history": history}), named, steps=6, save_every=2)
    assert "metric history" in resume_problem(TrainState(2, meta={"history": [[3, {}]]}), 2, steps=6, save_every=2)


def test_checkpoints_carry_their_manifest_and_final_holds_only_the_final_policy(tiny_world, tmp_path):
    out = tmp_path / "out"
    run_id = _train(tiny_world, 5, "--out", str(out))
    assert _names(run_id, "checkpoints") == ["final", "step_2", "step_4"]
    assert _names(run_id, "checkpoints/step_2") == STEP_FILES
    # the final policy has a directory of its own: no copies of step_N/, log.jsonl or the run marker
    assert _names(run_id, "checkpoints/final") == FINAL_FILES
    for step in ("step_2", "step_4"):  # the local copies carry the same manifest
        assert CK.verify_manifest(str(out / step)) is None
        assert (out / step / CK.MANIFEST).read_bytes() == open(os.path.join(_artifacts(run_id), "checkpoints",
                                                                            step, CK.MANIFEST), "rb").read()
    assert (out / "policy.safetensors").exists() and (out / "config.json").exists()  # --out's layout as before


def _rewrite_step(state_path: str, step: int) -> None:
    with open(state_path) as f:
        state = json.load(f)
    with open(state_path, "w") as f:
        json.dump({**state, "step": step}, f)


def test_resume_skips_incomplete_and_inconsistent_checkpoints_and_keeps_no_register(tiny_world):
    run_id = _train(tiny_world, 13)
    store = os.path.join(_artifacts(run_id), "checkpoints")
    os.remove(os.path.join(store, "step_12", CK.MANIFEST))  # its upload stopped before the manifest
    # an edited training state, its manifest rewritten to match: the files are whole, the state impossible
    _rewrite_step(os.path.join(store, "step_10", "train_state.json"), 100000)
    CK.write_manifest(os.path.join(store, "step_10"))
    open(os.path.join(store, "step_8", "config.json"), "w").close()  # the 0-byte config.json
    os.remove(os.path.join(store, "step_6", "train_state.safetensors"))
    with open(os.path.join(store, "step_4", "policy.safetensors"), "r+b") as f:  # same size, other bytes
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    mlflow.MlflowClient().set_terminated(run_id, "FAILED")
    res = _resume(run_id)
    size = json.load(open(os.path.join(store, "step_8", CK.MANIFEST)))["files"]["config.json"]["size"]
    skipped = [line for line in res.stderr.splitlines() if line.startswith("skipped ")]
    assert skipped == [
        "skipped checkpoints/step_12: incomplete upload (no MANIFEST.json)",
        "skipped checkpoints/step_10: its training state is at step 100000, outside the run's 1..12 (steps 13)",
        f"skipped checkpoints/step_8: incomplete upload (config.json: 0 bytes, manifest says {size})",
        "skipped checkpoints/step_6: incomplete upload (train_state.safetensors: missing)",
        "skipped checkpoints/step_4: incomplete upload (policy.safetensors: sha256 differs from the manifest's)",
    ], res.stderr
    assert f"resuming run {run_id} at step 2 of 13" in res.stderr
    assert f"not registering: run {run_id} was started with --no-register" in res.stderr
    assert "/tmp" not in "\n".join(skipped)  # names the artifacts, never a temporary directory
    _assert_finished_whole(run_id, 13, start=2)


# The uploads of a 6-step run saving every 2: step_2 (5 files, its manifest last), step_4 (5), final (3).
# Killed after K files, the newest whole checkpoint is step_4 from K = 10, step_2 from K = 5, none before.
KILL_POINTS = {k: (4 if k >= 10 else 2 if k >= 5 else 0,
                   "step_4" if 5 < k < 10 else "step_2" if 0 < k < 5 else None) for k in range(13)}
FAST = (7,)  # from step_2 past a partial step_4 (the issue); 3 (from the start past a partial step_2) is slow


@pytest.mark.parametrize("uploaded", [pytest.param(k, marks=() if k in FAST else pytest.mark.slow)
                                      for k in KILL_POINTS])
def test_sigkill_at_any_point_of_the_uploads_then_resume_finishes(tiny_world, tracking_uri, uploaded):
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "RLHF_THREADS": "1", KILL_AFTER_UPLOADS: str(uploaded)}
    killed = subprocess.run([RLHF_MLFLOW, *_args(tiny_world, 6)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.info.status == "RUNNING"
    if uploaded % 2:  # the documented order; a dead process on this host also resumes without it
        assert CliRunner().invoke(cli, ["runs", "--repair"]).exit_code == 0
        assert mlflow.get_run(run.info.run_id).info.status == "FAILED"
    start, partial = KILL_POINTS[uploaded]
    res = _resume(run.info.run_id)
    assert f"resuming run {run.info.run_id} at step {start} of 6" in res.stderr
    skipped = [line for line in res.stderr.splitlines() if line.startswith("skipped ")]
    assert skipped == ([f"skipped checkpoints/{partial}: incomplete upload (no MANIFEST.json)"] if partial else [])
    _assert_finished_whole(run.info.run_id, 6, start)
