"""`main --rounds`: a later round repairs the reward model with every label so far and trains, certifies,
releases and grades the corrected recipes on it, all as nested runs of main's (issue 30)."""
from __future__ import annotations

import json
import os

import mlflow
import pytest

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.main_rounds import labels_so_far, recipe_of
from rlhf_mlflow.tracking import rm_registry as RMR


def test_a_candidate_name_gives_back_its_recipe():
    assert recipe_of("r2-corrected-kl005-s1200") == "corrected-kl005-s1200"
    assert recipe_of("corrected-s800") == "corrected-s800" and recipe_of("rx-a") == "rx-a"


def test_labels_so_far_counts_each_request_once(tmp_path):
    row = {"id": "req-v1-anvil-000", "family": "anvil", "attrs": [0, 1, 2, 3], "response": ["ba"] * 8, "label": 0.5}
    D.write_jsonl(str(tmp_path / "labels-v1.jsonl"), [row])
    D.write_jsonl(str(tmp_path / "labels-r2-v1.jsonl"), [row, {**row, "id": "req-v1-anvil-001"}])
    D.write_jsonl(str(tmp_path / "label_requests-v1.jsonl"), [{k: v for k, v in row.items() if k != "label"}])
    assert [r["id"] for r in labels_so_far(str(tmp_path))] == ["req-v1-anvil-000", "req-v1-anvil-001"]


@pytest.mark.slow
def test_a_second_round_repairs_the_reward_model_and_trains_certifies_and_releases_on_it(tiny_world, tmp_path):
    from rlhf_mlflow.steps.main import run_main
    out = str(tmp_path / "out")
    table = run_main(WorldPaths.at(tiny_world), out, steps_scale=0.05, ceiling=False, echo=lambda m: None,
                     label_budget=1200, rounds=2)
    records = table.attrs["rounds"]
    assert [r["round"] for r in records] == [2]
    rec = records[0]
    assert json.load(open(os.path.join(out, "rounds.json")))[0]["rm_version"] == rec["rm_version"]
    runs = mlflow.search_runs(search_all_experiments=True)
    main_id = runs.loc[runs["tags.rlhf.step"] == "main", "run_id"].iloc[0]
    round_run = runs[runs["tags.rlhf.step"] == "round"].iloc[0]
    assert round_run["tags.mlflow.parentRunId"] == main_id
    repair = runs[runs["tags.rlhf.step"] == "repair_rm"].iloc[0]
    assert repair["tags.mlflow.parentRunId"] == round_run["run_id"]
    mv = mlflow.MlflowClient().get_model_version(RMR.RM_MODEL, rec["rm_version"])
    assert mv.tags["parent_version"] != "none" and int(mv.tags["expert_labels"]) > rec["repair_labels"]
    assert rec["labels_spent"] <= 1200
    if not rec["rm_promoted"]:
        assert mv.description.startswith("REFUSED")
        return
    # the round's candidates were trained on the repaired model, then certified, released and graded
    assert len(rec["versions"]) == 2
    later = table[table["candidate"].str.startswith("r2-")]
    assert sorted(later["model_version"]) == sorted(rec["versions"])
    assert later["decision"].notna().all() and later["truth_balanced"].notna().all()
    trained = runs[runs["tags.rlhf.round"] == "2"]
    assert len(trained) == 2 and all(p.endswith("reward_model_r2") for p in trained["params.reward_model"])
