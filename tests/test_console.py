"""What a user reads: the usage line of an entry point given a bad value, the launcher's run named
before the arguments are parsed, progress and warnings that say whose they are, each line once, and
the README's pandas snippet as written, from any directory."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import mlflow

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
