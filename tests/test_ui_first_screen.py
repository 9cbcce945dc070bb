"""What MLflow's UI shows first: the experiment opens on its runs (its kind), its description names
the champion and why the others are not, and the candidates view's columns are tags each candidate's
training run carries. A real store in a temp dir; the browser test is in test_ui_browser.py."""
from __future__ import annotations

import json

import mlflow
import pandas as pd

from rlhf_mlflow.steps.main import view as main_view
from rlhf_mlflow.tracking import experiment_view as EV
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T


def test_a_step_creates_its_experiment_as_one_the_ui_opens_on_its_runs():
    with T.tracked_run("diagnostic", {"x": 1}) as run:
        pass
    tags = mlflow.MlflowClient().get_experiment(run.info.experiment_id).tags
    assert tags[EV.KIND_TAG] == "custom_model_development"


def test_a_kind_a_user_chose_is_kept():
    client = mlflow.MlflowClient()
    exp = client.create_experiment("theirs", tags={EV.KIND_TAG: "genai_development"})
    EV.mark_kind(exp)
    assert client.get_experiment(exp).tags[EV.KIND_TAG] == "genai_development"
    other = client.create_experiment("bare")  # `mlflow run --experiment-name` creates it without a kind
    EV.mark_kind(other)
    assert client.get_experiment(other).tags[EV.KIND_TAG] == EV.KIND


def _candidates(n: int) -> tuple[str, list[str]]:
    """`n` training runs, each registered as a version of the policy model (the weights are not needed)."""
    client = mlflow.MlflowClient()
    exp = mlflow.set_experiment("rlhf_mlflow").experiment_id
    client.create_registered_model(REG.REGISTERED_MODEL)
    run_ids = []
    for i in range(n):
        with mlflow.start_run(run_name=f"cand{i}") as run:
            run_ids.append(run.info.run_id)
        client.create_model_version(REG.REGISTERED_MODEL, f"runs:/{run.info.run_id}/policy", run.info.run_id)
    return exp, run_ids


def _table() -> pd.DataFrame:
    return pd.DataFrame([
        {"candidate": "default-s800", "model_version": "1", "decision": "refused", "champion": False,
         "refused_by": "family_quality, certifiable", "certified_balanced": None, "certified_lo": None,
         "certified_hi": None, "truth_balanced": 0.342},
        {"candidate": "corrected-kl005-s1200", "model_version": "2", "decision": "promoted", "champion": True,
         "refused_by": "", "certified_balanced": 0.5261, "certified_lo": 0.4712, "certified_hi": 0.5764,
         "truth_balanced": 0.518},
        {"candidate": "kl05-s800", "model_version": "3", "decision": "superseded by v2", "champion": False,
         "refused_by": "", "certified_balanced": 0.31, "certified_lo": 0.30, "certified_hi": 0.33,
         "truth_balanced": None}])


def test_the_front_page_names_the_champion_first_and_every_other_candidate_with_its_verdict():
    exp, run_ids = _candidates(3)
    link = main_view.publish(_table(), exp, "mainrun", loosened=[])
    client = mlflow.MlflowClient()
    note = client.get_experiment(exp).tags[EV.NOTE_TAG]
    first, *rest = note.splitlines()
    # the one line the experiment page shows before its fold: the champion, the view's link, why not the others
    assert first == ("Champion: v2 corrected-kl005-s1200, certified balanced 0.526 [0.471, 0.576], true 0.518 · "
                     f"[every candidate with its verdict]({link}) · refused: v1 family_quality · superseded: v3")
    assert "- v1 default-s800: refused by family_quality, certifiable" in rest
    assert "- v3 kl05-s800: superseded by v2" in rest
    assert f"[every candidate with its verdict]({link})" in rest[-1] and f"#/experiments/{exp}/runs/mainrun" in note
    # the view's columns are the tags on each candidate's run
    view = json.loads(client.get_experiment(exp).tags[EV.VIEW_TAG_PREFIX + EV.VIEW_KEY])
    assert link == f"#/experiments/{exp}/runs?viewStateShareKey={EV.VIEW_KEY}"
    assert EV.VERDICT in view["searchFilter"]  # the candidates only
    # filtered and not sorted by creation time: MLflow's table shows them as top-level rows, not under main
    assert view["orderByKey"] not in ("", "attributes.start_time")
    assert view["runsHiddenMode"] == "SHOW_ALL"
    shown = {c.split("`")[1] for c in view["selectedColumns"] if c.startswith("tags.")}
    assert {EV.VERDICT, EV.CERTIFIED, EV.TRUTH} <= shown
    # widths apply only to columns in columnOrder; a verdict naming every guardrail fits its column
    assert view["columnOrder"] == view["selectedColumns"]
    longest = "refused v2: certifiable, balanced_gain, family_change, family_kl, marker_collapse"
    assert view["columnWidths"][f"tags.`{EV.VERDICT}`"] >= 6.5 * len(longest)
    assert view["columnWidths"][f"tags.`{EV.CERTIFIED}`"] >= 6.5 * len("0.502 [0.470, 0.536]")
    tags = [client.get_run(r).data.tags for r in run_ids]
    assert [t[EV.VERDICT] for t in tags] == ["refused v1: family_quality, certifiable", "champion v2",
                                                "superseded v3 by v2"]
    assert [t[EV.CERTIFIED] for t in tags] == ["not certifiable", "0.526 [0.471, 0.576]", "0.310 [0.300, 0.330]"]
    assert [t[EV.TRUTH] for t in tags] == ["0.342", "0.518", "not graded"]


def test_why_not_names_each_refused_version_by_the_first_guardrail_it_failed():
    table = pd.DataFrame([
        {"model_version": "3", "decision": "refused", "champion": False, "refused_by": "certifiable, family_kl"},
        {"model_version": "8", "decision": "refused", "champion": False, "refused_by": "beats_champion"},
        {"model_version": "2", "decision": "refused", "champion": False,
         "refused_by": "certifiable, balanced_gain, marker_collapse"},
        {"model_version": "7", "decision": "superseded by v1", "champion": False, "refused_by": ""},
        {"model_version": "6", "decision": "superseded by v7", "champion": False, "refused_by": ""},
        {"model_version": "1", "decision": "promoted", "champion": True, "refused_by": ""}])
    assert main_view.why_not(table) == ["refused: v2, v3 not certifiable; v8 beats_champion", "superseded: v6, v7"]
    assert main_view.why_not(table[table["champion"]]) == []


def test_without_a_champion_the_front_page_says_so_and_names_a_loosened_gate():
    exp, _ = _candidates(3)
    table = _table().assign(champion=False)
    main_view.publish(table, exp, "mainrun", loosened=["min_balanced_gain=-1"])
    first = mlflow.MlflowClient().get_experiment(exp).tags[EV.NOTE_TAG].splitlines()[0]
    assert first.startswith("No champion from this run") and "NON-DEFAULT guardrails: min_balanced_gain=-1" in first


def test_the_rlhf_app_is_mlflows_server_with_the_ui_defaults_script(tmp_path):
    """`mlflow server --app-name rlhf`: the index page opens the UI on model training with the
    assistant closed (unless the browser chose otherwise); the REST API is MLflow's."""
    import urllib.request

    from conftest import rlhf_ui_server

    from rlhf_mlflow.tracking.ui_app import BOOTSTRAP
    with rlhf_ui_server(f"sqlite:///{tmp_path}/ui.db", tmp_path) as url:
        index = urllib.request.urlopen(url + "/", timeout=10).read().decode()
        assert index.startswith("<!doctype html>") and BOOTSTRAP in index and index.count(BOOTSTRAP) == 1
        assert index.index(BOOTSTRAP) < index.index("<script defer")  # before the UI's own code runs
        assert '"mlflow.workflowType_v1": "machine_learning"' in BOOTSTRAP
        assert "localStorage.getItem(k)===null" in BOOTSTRAP  # a choice the user made is kept
        body = json.loads(urllib.request.urlopen(url + "/api/2.0/mlflow/experiments/search?max_results=5",
                                                 timeout=10).read())
        assert [e["name"] for e in body["experiments"]] == ["Default"]


def test_a_release_leaves_one_failed_tag_per_guardrail_it_failed_and_none_from_before():
    from rlhf_mlflow.steps.reports import TAG_CHARS, failed_tags
    _candidates(1)
    report = {"families": {"ember": {"certifiable": False, "reason": "ESS 6.9 < 10 of 40"},
                           "dune": {"certifiable": True, "reason": "ok"}}, "balanced": {}}
    first = {"certifiable": (False, "not certifiable: ember (ESS 6.9 < 10 of 40)"),
             "family_change": (False, "worse than the reference: ember -0.081 [-0.12, -0.04]"),
             "beats_champion": (False, "certified balanced 0.086 vs champion 0.089"), "family_kl": (True, "ok")}
    REG.set_failed("1", failed_tags(first, report, REG.FAILED))
    tags = REG.get_version("1").tags
    assert {k for k in tags if k.startswith(REG.FAILED)} == {"failed.certifiable", "failed.family_change",
                                                            "failed.beats_champion"}
    assert tags["failed.certifiable"] == "ember" and tags["failed.family_change"] == "ember"
    assert all(len(k) + len(v) <= TAG_CHARS for k, v in tags.items() if k.startswith(REG.FAILED))
    REG.set_failed("1", failed_tags({"family_kl": (False, "KL 5.2 > 4 in dune")}, report, REG.FAILED))
    tags = REG.get_version("1").tags  # a later release: only what it failed
    assert {k: v for k, v in tags.items() if k.startswith(REG.FAILED)} == {"failed.family_kl": "dune"}
    REG.set_failed("1", {})
    assert not [k for k in REG.get_version("1").tags if k.startswith(REG.FAILED)]


def test_a_later_main_with_a_new_champion_relabels_the_former_one_in_the_view():
    exp, run_ids = _candidates(3)
    main_view.publish(_table(), exp, "main1", loosened=[])  # v2 champion
    client = mlflow.MlflowClient()
    client.set_registered_model_alias(REG.REGISTERED_MODEL, "champion", "3")  # a later main promoted v3
    later = _table().iloc[[2]].assign(champion=True, decision="promoted")
    main_view.publish(later, exp, "main2", loosened=[])
    verdicts = [client.get_run(r).data.tags[EV.VERDICT] for r in run_ids]
    assert verdicts == ["refused v1: family_quality, certifiable", "superseded v2 by v3", "champion v3"]
