"""What a user reads: the usage line of an entry point given a bad value, the launcher's run named
before the arguments are parsed, progress and warnings that say whose they are, each line once, and
the README's pandas snippet as written, from any directory."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import mlflow
import numpy as np
import pytest
from click.testing import CliRunner

from rlhf_mlflow.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_bad_entry_point_value_names_the_real_command_and_the_launched_run_keeps_the_step_name(tmp_path):
    """As `mlflow run . -e train_rl -P steps=abc` runs it: the launcher has created the run (a random
    name) and passes its id; the entry point fails on its arguments, before any step code."""
    client = mlflow.MlflowClient()
    run = client.create_run(client.create_experiment("console"))
    assert run.info.run_name != "train_rl"
    env = {**os.environ, "MLFLOW_RUN_ID": run.info.run_id}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "entrypoints", "train_rl.py"), "--steps", "abc",
                          "--world", ""], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines()[0] == "Usage: rlhf-mlflow train-rl [OPTIONS]", res.stderr
    assert "'rlhf-mlflow train-rl --help'" in res.stderr and "train-rl train-rl" not in res.stderr
    named = client.get_run(run.info.run_id)
    assert named.info.run_name == "train_rl" and named.data.tags["mlflow.runName"] == "train_rl"


def _point(step, values: dict[str, float], noise: float = 0.01):
    """A synthetic watch point (as tests/test_watch.py makes them)."""
    from rlhf_mlflow.decisions import watch as W
    z = np.random.default_rng(0).normal(0, 1, 200)
    fams = {**values, "balanced": float(np.mean(list(values.values())))}
    return W.WatchPoint(step, dict(fams), {f: noise for f in fams}, {f: v + noise * z for f, v in fams.items()},
                        {f: step / 100 for f in fams}, dict(fams), {f: "doubly_robust" for f in values})


def test_the_watchs_past_peak_warning_names_the_run(tiny_world, monkeypatch, caplog):
    """`main` trains candidates two at a time: each warning says whose it is."""
    from rlhf_mlflow.evidence.watch import PolicyWatch
    dune = {0: 0.30, 10: 0.34, 20: 0.36, 30: 0.25, 40: 0.2}
    monkeypatch.setattr(PolicyWatch, "estimate", lambda self, step, policy: _point(
        step, {f: (dune[step] if f == "dune" else 0.3) for f in self.families}))
    res = CliRunner().invoke(cli, ["train-rl", "--world", tiny_world, "--steps", "40", "--batch-prompts", "4",
                                   "--log-every", "20", "--watch-every", "10", "--watch-gold",
                                   "data/gold_calib.jsonl", "--no-register"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    warnings = [r.getMessage() for r in caplog.records if "past its peak" in r.getMessage()]
    assert warnings and all(w.startswith(f"{run.info.run_name}: step ") for w in warnings), warnings
    # unset options (reward_wrapper, family_weights, ...) are left out, not shown as '' in the UI
    assert "" not in run.data.params.values() and "reward_wrapper" not in run.data.params
    assert run.data.params["watch_every"] == "10"



def test_each_reference_epoch_is_printed_once(caplog):
    """The world builder prints each SFT epoch through its progress (`  reference epoch 1/3: ...`);
    train_sft does not log it a second time (it logs only when no one is told)."""
    import torch

    from rlhf_mlflow.core import vocab as V
    from rlhf_mlflow.world.build import _prompt_ids
    from rlhf_mlflow.world.reference import train_sft
    n = 8
    prompts = _prompt_ids(np.zeros(n, dtype=np.int64), np.zeros((n, V.N_ATTR), dtype=np.int64))
    responses = torch.full((n, V.RESP_LEN), V.CONTENT_LO, dtype=torch.long)
    targets = torch.full((n, V.RESP_LEN, V.N_CONTENT), 1 / V.N_CONTENT)
    told: list[int] = []
    with caplog.at_level(logging.INFO):
        train_sft(prompts, responses, targets, 2, 1e-2, 4, 0, lambda epoch, epochs, loss: told.append(epoch))
    assert told == [1, 2] and not [r for r in caplog.records if "epoch" in r.getMessage()]
    with caplog.at_level(logging.INFO):
        train_sft(prompts, responses, targets, 1, 1e-2, 4, 0)
    assert [r.getMessage()[:15] for r in caplog.records] == ["sft epoch 1/1: "]


def test_the_ceiling_run_prints_its_progress_under_its_name(tiny_world, tmp_path, monkeypatch, capsys):
    """main's last training (the champion's recipe on the oracle's true reward) prints progress lines,
    named, as the candidates do (on the default world it trains for about a minute after them)."""
    import pandas as pd

    from rlhf_mlflow.core.world_paths import WorldPaths
    from rlhf_mlflow.steps.main import run as main_step
    from rlhf_mlflow.tracking import runs as T
    monkeypatch.setattr(main_step, "CEILING_PROGRESS_EVERY", 1e-9)  # a line at every report
    champion = SimpleNamespace(version=1, tags={"recipe": "default-s800", "checkpoint_step": "4"})
    table = pd.DataFrame({"model_version": ["1"], "truth_balanced": [0.3]})
    with T.tracked_run("main", run_name="main"):  # the ceiling is a child of main's run
        main_step._ceiling(WorldPaths(tiny_world), str(tmp_path / "out"), champion, table, 0.005, lambda m: None)
    err = capsys.readouterr().err
    assert re.search(r"^  ceiling-default-s800: step 4/4 \(\d+ s\), proxy ", err, re.M), err
    assert table.attrs["ceiling"]["steps"] == 4


def _readme_history_snippet() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (snippet,) = [b for b in blocks if "history.leaderboard" in b]
    return snippet


@pytest.mark.slow  # three interpreters importing mlflow: ~20 s of a suite kept under 10 minutes
def test_the_readmes_pandas_snippet_runs_as_written_from_any_directory(tmp_path, tmp_path_factory):
    """Against a real store holding a train_rl run: from a directory below the checkout, from one outside
    it with MLFLOW_TRACKING_URI, and, in a checkout without a store, a clear error and no new ./mlflow.db."""
    from rlhf_mlflow.tracking import runs as T
    (tmp_path / "MLproject").write_text("name: rlhf_mlflow\n")  # tmp_path: a checkout with its store
    with T.tracked_run("train_rl", {"kl_coef": 0.05, "steps": 20, "family_weights": ""}, run_name="kl005-s20"):
        T.log_metrics({"train/proxy/balanced": 0.75}, step=20)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    below, outside, empty = tmp_path / "a" / "b", tmp_path_factory.mktemp("outside"), tmp_path_factory.mktemp("bare")
    below.mkdir(parents=True)
    (empty / "MLproject").write_text("name: rlhf_mlflow\n")
    for cwd, extra in ((below, {}), (outside, {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})):
        res = subprocess.run([sys.executable, "-c", _readme_history_snippet()], cwd=cwd, env={**env, **extra},
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        header, row = res.stdout.splitlines()[:2]
        assert header.split() == ["run_name", "kl_coef", "steps", "train/proxy/balanced"], res.stdout
        assert row.split() == ["0", "kl005-s20", "0.05", "20", "0.75"], res.stdout
        assert not (cwd / "mlflow.db").exists()
    res = subprocess.run([sys.executable, "-c", _readme_history_snippet()], cwd=empty, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 1 and f"no rlhf_mlflow tracking store at {empty}/mlflow.db" in res.stderr, res.stderr
    assert not (empty / "mlflow.db").exists()


def test_unset_params_are_left_out_and_a_launchers_raw_value_is_kept_beside_the_resolved_one():
    from rlhf_mlflow.tracking import runs as T
    with T.tracked_run("console", {"gold": "", "policy": None, "seed": 0, "world": "w"}) as run:
        T.log_params({"world": "/abs/w", "steps": ""})
    assert mlflow.get_run(run.info.run_id).data.params == {"seed": "0", "world": "w", "resolved.world": "/abs/w"}
