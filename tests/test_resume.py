"""A train_rl run survives its process: SIGTERM ends it KILLED with every metric point stored; after
SIGKILL, `train-rl --resume RUN_ID` finishes the same run from its last checkpoint, each metric with
exactly one point per step, and the final policy and the over-optimisation watch's fits, flags and best
step equal an uninterrupted run's (one thread)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import mlflow
import pytest
import torch
from click.testing import CliRunner

from rlhf_mlflow.cli import cli
from rlhf_mlflow.core import model as M
from rlhf_mlflow.tracking import runs as T

RLHF_MLFLOW = os.path.join(os.path.dirname(sys.executable), "rlhf-mlflow")
STEPS, SAVE_EVERY = 120, 30


def _train(world: str, out, uri: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "RLHF_THREADS": "1"}
    args = [RLHF_MLFLOW, "train-rl", "--world", world, "--steps", str(STEPS), "--log-every", "1",
            "--save-every", str(SAVE_EVERY), "--batch-prompts", "8", "--samples-per-prompt", "4", "--no-register",
            "--out", str(out), *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.isdir(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.02)


def _only_run():
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.step` = 'train_rl'",
                                output_format="list")
    return run


def _history_steps(run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in mlflow.MlflowClient().get_metric_history(run_id, key))


def test_a_sigterm_whose_interrupt_python_dropped_still_ends_the_run_killed(tracking_uri, monkeypatch):
    """The handler runs wherever the main thread is; inside a weakref callback (an import lock's, under
    load) Python drops what it raises. The step must still end KILLED, and quietly."""
    import weakref

    from rlhf_mlflow.core import process
    monkeypatch.setattr(process, "_received", [])
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # pytest's own SIGTERM handling stays as it is
    process.handle_signals()
    dropped = []
    monkeypatch.setattr(process, "_prior_hook", dropped.append)

    class Box:
        pass
    with pytest.raises(KeyboardInterrupt):
        with T.tracked_run("probe"):
            box = Box()
            ref = weakref.ref(box, lambda _: process._interrupt(signal.SIGTERM, None))
            del box  # the callback's KeyboardInterrupt is dropped here: the step's code runs on
            assert ref() is None and process._received == [signal.SIGTERM]
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.info.status == "KILLED"
    assert dropped == []  # nothing printed for the dropped interrupt
    sys.unraisablehook(type("Info", (), {"exc_value": ValueError("other")})())
    assert len(dropped) == 1  # any other unraisable exception is reported as before


def test_sigterm_marks_the_run_killed_and_keeps_every_metric_point(tiny_world, tmp_path, tracking_uri):
    proc = _train(tiny_world, tmp_path / "out", tracking_uri)
    _wait_for(tmp_path / "out" / f"step_{SAVE_EVERY}", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    run = _only_run()
    assert run.info.status == "KILLED" and run.info.end_time
    steps = _history_steps(run.info.run_id, "train/proxy/balanced")
    # contiguous from step 1: the points buffered when the signal came were flushed, none lost
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= SAVE_EVERY


# slow (41 s): a real train-rl process killed and resumed; tests/test_checkpoint_uploads.py kills one at
# every point of the uploads in the fast suite
@pytest.mark.slow
def test_sigkill_then_resume_finishes_the_same_run_as_if_uninterrupted(tiny_world, tmp_path, tracking_uri):
    watch = ("--watch-every", "20", "--watch-gold", os.path.join(tiny_world, "data", "gold_calib.jsonl"))
    straight = _train(tiny_world, tmp_path / "straight", tracking_uri, "--run-name", "straight", *watch)
    assert straight.wait(600) == 0, straight.communicate()
    killed = _train(tiny_world, tmp_path / "killed", tracking_uri, "--run-name", "killed", *watch)
    # once the second checkpoint is on disk, the first is in the run's artifacts
    _wait_for(tmp_path / "killed" / f"step_{2 * SAVE_EVERY}", killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(60)
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="attributes.run_name = 'killed'",
                                output_format="list")
    assert run.info.status == "RUNNING"  # nobody could mark it: the process had no chance
    resumed = subprocess.run([RLHF_MLFLOW, "train-rl", "--resume", run.info.run_id, "--no-register",
                              "--out", str(tmp_path / "resumed")], capture_output=True, text=True,
                             env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "RLHF_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming run {run.info.run_id} at step" in resumed.stderr
    run = mlflow.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and int(run.data.tags["rlhf.resumed_from_step"]) >= SAVE_EVERY
    for key in ("train/proxy/balanced", "train/kl/balanced", "train/stats/loss", "train/stats/entropy"):
        assert _history_steps(run.info.run_id, key) == list(range(1, STEPS + 1)), key
    # a family's curve has a point at the steps that drew it: the same steps and values as the straight run
    (first,) = mlflow.search_runs(search_all_experiments=True, filter_string="attributes.run_name = 'straight'",
                                  output_format="list")
    assert os.path.exists(tmp_path / "killed" / f"step_{SAVE_EVERY}" / "watch_state.json")
    # the watch went on from its state in the checkpoint: its past-peak flags and its best step are the
    # straight run's (a watch started afresh would know only the points after the resume); its Gao fits
    # are the table watch_gao_fits.json and the tag rlhf.watch.peaks, not metrics: here, that the tag is set
    assert run.data.tags.get("rlhf.watch.best_step") == first.data.tags.get("rlhf.watch.best_step") is not None
    assert "rlhf.watch.peaks" in run.data.tags
    watch_keys = [k for k in first.data.metrics if k.startswith("watch/past_peak/")]
    assert watch_keys and set(watch_keys) <= set(run.data.metrics)
    for key in ("train/kl/dune", "train/proxy/ember", "watch/balanced", *watch_keys):
        ours, theirs = (sorted((m.step, m.value) for m in mlflow.MlflowClient().get_metric_history(r, key))
                        for r in (run.info.run_id, first.info.run_id))
        assert [s for s, _ in ours] == [s for s, _ in theirs], key
        assert all(abs(a - b) < 1e-4 * max(1.0, abs(b)) for (_, a), (_, b) in zip(ours, theirs)), key
    a = M.load_policy(str(tmp_path / "straight"))[0].state_dict()
    b = M.load_policy(str(tmp_path / "resumed"))[0].state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a), max((a[k] - b[k]).abs().max() for k in a)


def _resume(run_id: str, *extra):
    return CliRunner().invoke(cli, ["train-rl", "--resume", run_id, *extra])


def test_runs_that_cannot_resume_say_why(tiny_world, tmp_path):
    res = CliRunner().invoke(cli, ["train-rl", "--world", tiny_world, "--steps", "2", "--batch-prompts", "4",
                                   "--samples-per-prompt", "2", "--no-register"])
    assert res.exit_code == 0, res.output
    done = _only_run().info.run_id
    res = _resume(done)
    assert res.exit_code == 1 and "already FINISHED: nothing to resume" in res.output
    res = _resume(done, "--kl-coef", "0.5")
    assert res.exit_code == 2 and "--resume continues the run with its own config; drop kl_coef" in res.output
    res = _resume("0" * 32)
    assert res.exit_code == 1 and "does not exist" in res.output
    with T.tracked_run("certify") as other:
        pass
    res = _resume(other.info.run_id)
    assert res.exit_code == 1 and "is a 'certify' run; only train_rl runs resume" in res.output
    with T.tracked_run("train_rl") as alive:  # RUNNING, and this very process is its process
        res = _resume(alive.info.run_id)
    assert res.exit_code == 1 and "is still running (pid" in res.output


@pytest.mark.parametrize("phase", ["missing", "changed"])
def test_resume_refuses_inputs_that_moved(tiny_world, tmp_path, phase):
    import shutil
    world = tmp_path / "w"
    shutil.copytree(tiny_world, world)
    with T.tracked_run("train_rl") as run:  # a run that died before saving anything, with its config
        from dataclasses import asdict

        from rlhf_mlflow.steps.train_rl import CONFIG_ARTIFACT, input_hashes
        from rlhf_mlflow.training.rl_config import load_rl_config
        cfg = load_rl_config(str(world / "configs" / "default.json"), {"steps": 2})
        T.log_params(input_hashes(cfg))
        T.log_json_artifact(asdict(cfg), CONFIG_ARTIFACT)
    mlflow.MlflowClient().set_terminated(run.info.run_id, "FAILED")
    if phase == "missing":
        os.remove(world / "data" / "prompts_train.jsonl")
    else:
        with open(world / "data" / "prompts_train.jsonl", "a") as f:
            f.write('{"id": "extra", "family": "dune", "attrs": [0, 0, 0, 0]}\n')
    res = _resume(run.info.run_id)
    assert res.exit_code == 1 and "cannot be resumed" in res.output and "prompt_file" in res.output, res.output


def test_a_resumed_run_registers_the_watch_best_checkpoint_it_was_started_to(tiny_world, tmp_path):
    """A run started with select="watch_best" (main's corrected candidates) that fails mid-way (its reward
    wrapper raises once a flag file exists) registers the watch's best checkpoint when resumed, as the
    uninterrupted run would, not its final one."""
    from rlhf_mlflow.core.errors import InputError
    from rlhf_mlflow.core.world_paths import WorldPaths
    from rlhf_mlflow.steps.train_rl import resume_train_rl, run_train_rl
    from rlhf_mlflow.training.rl_config import load_rl_config

    flag, wrapper = tmp_path / "machine_lost", tmp_path / "flaky.py"
    wrapper.write_text("import os\ncalls = 0\n\n\ndef transform(records, tokens, rewards):\n    global calls\n"
                       f"    calls += 1\n    if calls > 50 and os.path.exists({str(flag)!r}):\n"
                       "        raise RuntimeError('the machine went away')\n    return rewards\n")
    cfg = load_rl_config(os.path.join(tiny_world, "configs", "default.json"),
                         {"steps": 80, "save_every": 20, "batch_prompts": 8, "samples_per_prompt": 4, "log_every": 10,
                          "watch_every": 20, "watch_gold": os.path.join(tiny_world, "data", "gold_calib.jsonl"),
                          "reward_wrapper": str(wrapper)})
    flag.write_text("")
    with pytest.raises(InputError, match="the machine went away"):
        run_train_rl(cfg, world=WorldPaths.at(tiny_world), run_name="flaky", select="watch_best", progress=False,
                     echo=lambda m: None)
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="attributes.run_name = 'flaky'",
                                output_format="list")
    assert run.info.status == "FAILED" and run.data.tags["rlhf.select"] == "watch_best"
    flag.unlink()
    summary = resume_train_rl(run.info.run_id, echo=lambda m: None, progress=False)
    run = mlflow.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and int(run.data.tags["rlhf.resumed_from_step"]) >= 20
    best = run.data.tags["rlhf.watch.best_step"]
    assert str(summary["registered_step"]) == best == run.data.tags["rlhf.registered_step"]
    version = mlflow.MlflowClient().get_model_version("rlhf-policy", str(summary["model_version"]))
    assert version.tags["checkpoint_step"] == best
