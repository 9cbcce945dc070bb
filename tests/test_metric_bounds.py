"""No metric a step logs is non-finite or absurd: the guard every metric goes through
(tracking/metric_bounds.py), and the steps on the test-scale world checked against it, value by value."""
from __future__ import annotations

import logging
import math

import mlflow
import pytest
from click.testing import CliRunner

from rlhf_mlflow.cli import cli
from rlhf_mlflow.tracking import metric_bounds as B
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.metric_logger import MetricLogger

GUARD = "rlhf_mlflow.tracking.metric_bounds"


@pytest.mark.parametrize("name, lo, hi", [
    ("truth/balanced", 0, 1), ("certify/certified/balanced", -1, 2), ("watch/dune", -1, 2),
    ("watch/se/dune", 0, 1), ("train/kl/dune", -1e3, 1e3), ("train/stats/kl_k3", 0, 1e3),
    ("train/stats/entropy", 0, 100), ("train/stats/top_token_share", 0, 1), ("train/stats/steps_per_s", 0, 1e7),
    ("watch/gao_peak_kl/dune", 0, 1e3), ("certify/policy_labels/total", 0, 1e9), ("requests/dune", 0, 1e9),
    ("release/promoted", 0, 1), ("certify/families_certified", 0, 1e3), ("dev/rm_gold_pearson", -1, 1),
    ("main/seconds", 0, 1e7), ("rm/loss", *B.ANY),
])
def test_each_kind_of_metric_has_the_range_its_numbers_can_take(name, lo, hi):
    assert B.bounds(name) == (lo, hi)


def test_the_guard_drops_non_finite_and_absurd_values_with_a_warning(caplog):
    metrics = {"train/kl/dune": 0.4, "watch/gao_peak_kl/dune": 1e43, "truth/dune": 1.2, "train/stats/loss": math.nan,
               "certify/gain/balanced": math.inf, "labels/total": -1, "dev/proxy_mean": "x", "truth/balanced": 0.5}
    with caplog.at_level(logging.WARNING, logger=GUARD):
        assert B.checked(metrics) == {"train/kl/dune": 0.4, "truth/balanced": 0.5}
    dropped = {r.getMessage().split()[1] for r in caplog.records}
    assert dropped == set(metrics) - {"train/kl/dune", "truth/balanced"}
    assert "1e+43 is outside [0, 1000]" in caplog.text and "nan is not finite" in caplog.text


def test_what_the_guard_drops_never_reaches_the_store():
    with T.tracked_run("test") as run:
        T.log_metrics({"truth/balanced": 0.5, "truth/dune": math.nan})
        logger = MetricLogger(prefix="train/")
        logger(1, {"kl/dune": 0.3, "kl/ember": math.inf, "kl/anvil": 1e43})
        logger.flush(synchronous=True)
    assert set(mlflow.get_run(run.info.run_id).data.metrics) == {"truth/balanced", "train/kl/dune"}


@pytest.mark.slow
def test_no_step_logs_a_value_outside_its_range(tiny_world, caplog):
    """The steps on the test-scale world (train_rl with its watch, bon with its watch, dev_eval, certify,
    release, grade): the guard drops nothing, and every point stored is finite and in its range (about
    75 s on two cores, hence slow)."""
    def run(*args):
        res = CliRunner().invoke(cli, [str(a) for a in args])
        assert res.exit_code == 0, (args, res.output)
    gold = "data/gold_calib.jsonl"
    with caplog.at_level(logging.WARNING, logger=GUARD):
        run("train-rl", "--world", tiny_world, "--steps", 4, "--batch-prompts", 4, "--log-every", 1,
            "--watch-every", 2, "--watch-gold", gold)
        run("dev-eval", "--policy", "models:/rlhf-policy/1", "--world", tiny_world)
        run("certify", "--model-version", 1, "--world", tiny_world)
        run("release", "--model-version", 1)
        run("grade", "--model-version", 1, "--world", tiny_world)
        run("bon", "--policy", f"{tiny_world}/policy", "--reward-model", f"{tiny_world}/reward_model", "--prompts",
            f"{tiny_world}/data/prompts_dev.jsonl", "--n", 4, "--limit", 12, "--watch-gold", f"{tiny_world}/{gold}")
    assert not [r.getMessage() for r in caplog.records if r.name == GUARD]
    client = mlflow.MlflowClient()
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert {r.data.tags["rlhf.step"] for r in runs} >= {"train_rl", "dev_eval", "certify", "release", "grade", "bon"}
    for r in runs:
        for key in r.data.metrics:
            for m in client.get_metric_history(r.info.run_id, key):
                assert B.problem(key, m.value) is None, (r.data.tags["rlhf.step"], key, m.step, m.value)
    by_step = {r.data.tags["rlhf.step"]: len(r.data.metrics) for r in runs}
    assert by_step["certify"] <= 8 and by_step["dev_eval"] <= 8 and by_step["grade"] <= 2 and by_step["release"] <= 2
