"""`main` end to end on a tiny world: one parent run, a child run per step, a summary table with a
row per candidate, and a champion (if any) whose guardrail tags all pass."""
from __future__ import annotations

import mlflow
import pytest
from click.testing import CliRunner

from rlhf_mlflow.cli import cli
from rlhf_mlflow.tracking.registry import release_record
from rlhf_mlflow.training.recipes import CORRECTED, SEED_HISTORY


@pytest.mark.slow
def test_main_runs_the_whole_story(tiny_world, tmp_path):
    res = CliRunner().invoke(cli, ["main", "--world", tiny_world, "--steps-scale", "0.01", "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    (parent,) = [r for r in runs if r.data.tags.get("rlhf.step") == "main"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    steps = {r.data.tags["rlhf.step"] for r in children}
    assert {"train_rl", "diagnostic", "correction", "dev_eval", "certify", "release", "grade"} <= steps
    assert all(r.info.status == "FINISHED" for r in children)
    table = res.output
    # main's second round (the default) trains the corrected recipes again on the repaired reward model
    expected = list(SEED_HISTORY) + list(CORRECTED) + [f"r2-{name}" for name in CORRECTED]
    for name in expected:
        assert f"| {name} |" in table
    client = mlflow.MlflowClient()
    versions = client.search_model_versions("name = 'rlhf-policy'")
    assert sorted(v.tags["recipe"] for v in versions) == sorted(expected)
    for v in versions:
        assert v.tags["release.decision"].split()[0] in ("promoted", "refused", "superseded")
        steps = int(mlflow.get_run(v.run_id).data.params["steps"])
        step = int(v.tags["checkpoint_step"])  # corrected: a saved quarter; history: the final step
        assert step == steps if v.tags["recipe"] in SEED_HISTORY else 0 < step <= steps
    try:
        champ = client.get_model_version_by_alias("rlhf-policy", "champion")
    except mlflow.exceptions.MlflowException:
        champ = None
    if champ is not None:
        assert all(g["pass"] for g in release_record(champ)["guardrails"].values())
        assert champ.tags["release.decision"] == "promoted"


@pytest.mark.slow
def test_a_second_main_in_the_same_store_keeps_an_unbeaten_champion(tiny_world, tmp_path):
    """Re-running main where an earlier run left a champion: candidates that do not beat it are
    refused (beats_champion), and main still finishes (the ceiling is skipped, not crashed on)."""
    client = mlflow.MlflowClient()
    args = ["main", "--world", tiny_world, "--steps-scale", "0.05", "--out", str(tmp_path / "out")]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    # whatever the first run promoted, give the champion alias to its best-certified version so that
    # the second run (same seeds, same candidates) cannot beat it
    versions = client.search_model_versions("name = 'rlhf-policy'")
    certified = {r.data.params["model_version"]: r.data.metrics.get("certify/certified/balanced", float("-inf"))
                 for r in mlflow.search_runs(search_all_experiments=True, output_format="list")
                 if r.data.tags.get("rlhf.step") == "certify"}
    best = max(versions, key=lambda v: certified.get(str(v.version), float("-inf")))
    client.set_registered_model_alias("rlhf-policy", "champion", best.version)
    again = CliRunner().invoke(cli, args)  # the same --out: a finished main's, replaced only with --overwrite
    assert again.exit_code == 1 and "already holds the files of main run" in again.output, again.output
    second = CliRunner().invoke(cli, [*args, "--overwrite"])
    assert second.exit_code == 0, second.output
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == best.version
    assert f"ceiling: skipped: the champion is version {best.version} from an earlier run" in second.output
