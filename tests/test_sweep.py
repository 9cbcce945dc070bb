"""Recipe sweeps: grid parsing and ranking by hand, then a real local Ray sweep of 4 tiny trials."""
from __future__ import annotations

import json

import mlflow
import pandas as pd
import pytest
from click.testing import CliRunner

from rlhf_mlflow.cli import cli
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.steps.ray_tune import (
    best_trial,
    expand_grid,
    parse_grid,
    rank_trials,
    trial_name,
)


def test_grid_parses_values_as_json_and_expands_in_order():
    grid = parse_grid(["kl_coef=0.02,0.05", "steps=800;seed=0,1", 'family_weights=[{"dune": 0}, null]'])
    assert grid == {"kl_coef": [0.02, 0.05], "steps": [800], "seed": [0, 1], "family_weights": [{"dune": 0}, None]}
    recipes = expand_grid(grid)
    assert len(recipes) == 8 and recipes[0] == {"kl_coef": 0.02, "steps": 800, "seed": 0, "family_weights": {"dune": 0}}
    assert trial_name(recipes[1]) == 'kl_coef=0.02,steps=800,seed=0,family_weights=null'
    assert expand_grid({}) == [{}] and trial_name({}) == "base"
    with pytest.raises(InputError, match="given twice"):
        parse_grid(["steps=1", "steps=2"])


def test_ranking_uses_certified_quality_with_every_guardrail_passing_never_proxy():
    frame = pd.DataFrame([
        # the proxy's favourite fails a guardrail; the second-best certified one wins
        {"trial": "a", "status": "FINISHED", "dev_proxy/balanced": 0.9, "certified/balanced": 0.60,
         "certified_lo/balanced": 0.5, "guardrail/family_change": False, "guardrail/family_kl": True},
        {"trial": "b", "status": "FINISHED", "dev_proxy/balanced": 0.4, "certified/balanced": 0.45,
         "certified_lo/balanced": 0.4, "guardrail/family_change": True, "guardrail/family_kl": True},
        {"trial": "c", "status": "FINISHED", "dev_proxy/balanced": 0.5, "certified/balanced": 0.40,
         "certified_lo/balanced": 0.3, "guardrail/family_change": True, "guardrail/family_kl": True},
        {"trial": "d", "status": "FINISHED", "dev_proxy/balanced": 0.7, "certified/balanced": None,
         "certified_lo/balanced": None, "guardrail/family_change": True, "guardrail/family_kl": True},
        {"trial": "e", "status": "ERROR"},
    ])
    ranked = rank_trials(frame)
    assert list(ranked["eligible"]) == [False, True, True, False, False]
    assert best_trial(ranked)["trial"] == "b"
    assert list(ranked["rank"].dropna()) == [1, 2]
    # no guardrail evaluated at all: nothing is eligible
    assert best_trial(rank_trials(frame.drop(columns=["guardrail/family_change", "guardrail/family_kl"]))) is None


FAMILY_CURVES = ["proxy", "kl", "stats/kl_k3", "stats/entropy", "stats/top_token_share", "stats/shaped"]


# slow (24 s each): a real local Ray cluster of four trials
@pytest.mark.slow
@pytest.mark.parametrize("batch", ["1", "2"])
def test_local_ray_sweep_of_four_trials(tiny_world, tmp_path, monkeypatch, batch):
    """4 single-thread trials side by side on a local Ray (alone, or two batched runs per Tune trial):
    each is a finished child run of the sweep with complete per-family curves, dev metrics, a
    certification and every guardrail; the best trial is the certified one, and its version carries
    the certification release reads."""
    monkeypatch.setenv("RLHF_BATCH_RUNS", batch)
    # the world's known shortcut as diagnostic evidence (the diagnostic itself is tested elsewhere)
    diagnostic = tmp_path / "diagnostic.json"
    diagnostic.write_text(json.dumps({"families": {"dune": {"risk": 0.9, "flag": True, "evidence": [
        {"kind": "token", "token": "pa", "risk": 0.9}]}}}))
    # 24 prompts a step, reports every 3 steps: every family is drawn in every window
    res = CliRunner().invoke(cli, [
        "sweep", "--world", tiny_world, "--steps", "6", "--log-every", "3", "--batch-prompts", "24",
        "--samples-per-prompt", "2", "--grid", "kl_coef=0.05,0.1", "--grid", "seed=0,1",
        "--diagnostic", str(diagnostic), *(["--release"] if "release" in cli.commands else []),
        # a 6-step policy cannot gain +0.03: loosen the gain thresholds so ranking has candidates
        "--guardrail", "min_balanced_gain=-1", "--guardrail", "require_significant_gain=false",
        "--guardrail", "min_family_change=-1", "--out", str(tmp_path / "trials.csv")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    client = mlflow.MlflowClient()
    (parent,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.step` = 'sweep'",
                                   output_format="list")
    assert parent.info.status == "FINISHED"
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    children = [r for r in runs if "rlhf.trial" in r.data.tags]  # the rest: the release step, if any
    assert len(children) == 4
    assert {c.data.tags["rlhf.trial"] for c in children} == {
        f"kl_coef={k},seed={s}" for k in (0.05, 0.1) for s in (0, 1)}
    for child in children:
        assert child.info.status == "FINISHED"
        for metric in FAMILY_CURVES:  # proxy and kl per family and balanced; the others balanced (family_curves.png)
            keys = [f"{metric}/{fam}" for fam in V.FAMILIES + ["balanced"]] if metric in ("proxy", "kl") else [metric]
            for key in keys:
                steps = [m.step for m in client.get_metric_history(child.info.run_id, f"train/{key}")]
                assert steps == [3, 6], (child.data.tags["rlhf.trial"], key, steps)
        assert {"trial/dev/proxy/balanced", "trial/dev/kl/dune"} <= set(child.data.metrics)
        assert {f"trial/guardrail/{g}" for g in ("certifiable", "balanced_gain", "family_change", "family_kl",
                                           "marker_collapse", "beats_champion")} <= set(child.data.metrics)
        # its certification: a certify run nested under the trial, which the version points at
        nested = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                    filter_string=f"tags.`mlflow.parentRunId` = '{child.info.run_id}'")
        assert sorted(r.data.tags["rlhf.step"] for r in nested) == ["certify", "dev_eval"]  # the steps' own runs
        (cert,) = [r for r in nested if r.data.tags["rlhf.step"] == "certify"]
        assert cert.data.tags["rlhf.step"] == "certify" and cert.info.status == "FINISHED"
        assert {"certify/certified/balanced", "certify/families_certified"} <= set(cert.data.metrics)
        version = client.get_model_version("rlhf-policy", _version_of(client, child.info.run_id))
        assert version.tags["certification.run_id"] == cert.info.run_id

    table = pd.read_csv(tmp_path / "trials.csv")
    assert len(table) == 4 and (table["status"] == "FINISHED").all()
    eligible = table[table["eligible"]]
    if len(eligible):
        best = eligible.sort_values("certified/balanced", ascending=False).iloc[0]
        assert parent.data.tags["rlhf.best_run_id"] == best["run_id"]
        assert f"best trial: {best['trial']}" in res.output
        if "release" in cli.commands:  # handed to release with the sweep's thresholds: promoted
            champion = client.get_model_version_by_alias("rlhf-policy", "champion")
            assert str(champion.version) == str(int(best["model_version"]))
    else:
        assert parent.data.tags["rlhf.best_trial"].startswith("none")
    for column in ("guardrail/certifiable", "guardrail/marker_collapse", "certified/balanced"):
        assert column in res.output


def _version_of(client, run_id: str) -> str:
    (mv,) = client.search_model_versions(f"name = 'rlhf-policy' and run_id = '{run_id}'")
    return mv.version


def test_cluster_sweep_refuses_a_local_store(tiny_world):
    res = CliRunner().invoke(cli, ["sweep", "--world", tiny_world, "--ray-address", "127.0.0.1:1"])
    assert res.exit_code == 1 and "cannot write to the local store" in res.output


def test_bad_grid_value_or_guardrail_fails_before_any_run(tiny_world):
    res = CliRunner().invoke(cli, ["sweep", "--world", tiny_world, "--grid", "kl_coef=0.1,-1"])
    assert res.exit_code == 1 and "kl_coef must be a number in [0, 100]" in res.output
    res = CliRunner().invoke(cli, ["sweep", "--world", tiny_world, "--guardrail", "max_kl=3"])
    assert res.exit_code == 1 and "unknown guardrail key 'max_kl'" in res.output
    assert not mlflow.search_runs(search_all_experiments=True, output_format="list")


def test_sweep_and_server_modules_import_without_mlflow():
    import subprocess
    import sys
    code = ("import sys\nimport rlhf_mlflow.steps.ray_tune, rlhf_mlflow.tracking.server, rlhf_mlflow.tracking.postgres\n"
            "bad = [m for m in sys.modules if m == 'mlflow' or m.startswith('mlflow.')]\nassert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
