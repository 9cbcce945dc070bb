"""Seed history replayed into a real store, and the pandas helpers over it."""
from __future__ import annotations

import mlflow
from click.testing import CliRunner

from rlhf_mlflow.cli import cli
from rlhf_mlflow.tracking import history
from rlhf_mlflow.training.recipes import SEED_HISTORY


def test_replay_history_logs_the_seed_runs_with_their_notes(tiny_world):
    res = CliRunner().invoke(cli, ["replay-history", "--world", tiny_world, "--steps-scale", "0.005",
                                   "--only", "default-s800", "--only", "kl05-s800"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    frame = history.runs(step="train_rl")
    assert set(frame["tags.mlflow.runName"]) == {"default-s800", "kl05-s800"}
    row = frame[frame["tags.mlflow.runName"] == "kl05-s800"].iloc[0]
    assert row["tags.mlflow.note.content"] == SEED_HISTORY["kl05-s800"][1]
    assert row["params.kl_coef"] == "0.5" and row["params.steps"] == "4"

    tidy = history.family_frame(frame)
    assert list(tidy.columns) == ["run_id", "run_name", "metric", "family", "value"]
    assert {"train/proxy", "train/kl"} <= set(tidy["metric"]) and "balanced" in set(tidy["family"])
    board = history.leaderboard(frame, "train/kl/balanced")
    assert list(board["train/kl/balanced"]) == sorted(board["train/kl/balanced"], reverse=True)
    assert {"run_name", "kl_coef", "steps"} <= set(board.columns)
    assert list(history.with_params(frame, kl_coef=0.5)["tags.mlflow.runName"]) == ["kl05-s800"]
    assert len(mlflow.MlflowClient().search_model_versions("name='rlhf-policy'")) == 2

    # a name from before the step prefixes still finds its column; the table fits 120 columns
    res = CliRunner().invoke(cli, ["runs", "--metric", "kl/balanced"], catch_exceptions=False)
    assert res.exit_code == 0 and "kl05-s800" in res.output and "train/kl/balanced" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 120


def test_replay_history_rejects_unknown_names(tiny_world):
    res = CliRunner().invoke(cli, ["replay-history", "--world", tiny_world, "--only", "nope"])
    assert res.exit_code == 1 and "valid runs are" in res.output
