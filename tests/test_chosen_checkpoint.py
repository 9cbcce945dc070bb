"""A checkpoint chosen on an expert set's estimates (the watch's best or proposal) is certified from labels on
its own samples only: the expert set that chose it is no evidence of its value (the winner's curse), and
release refuses a certification that counted it (steps/selection.py)."""
from __future__ import annotations

import json
import os

import mlflow
import pytest
from test_labels import LENIENT, _labelled, _run

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions.certify import CHOSEN_ON
from rlhf_mlflow.steps import selection as SEL
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.policy_model import REGISTERED_MODEL, log_policy

GATES = LENIENT + ",min_labels=4"


def _register(world: str, **watch) -> tuple[str, str]:
    """The world's reference policy registered from a train_rl run whose parameters say how its checkpoint
    was chosen (`watch`: the parameters train_rl logs), and that run's id."""
    with T.tracked_run("train_rl", {"policy": os.path.join(world, "policy"), **watch}) as run:
        _, mv = log_policy(os.path.join(world, "policy"), tags={"recipe": "chosen"})
    return str(mv.version), run.info.run_id


def _certification(version: str, *extra) -> tuple[str, dict]:
    client = mlflow.MlflowClient()
    run_id = client.get_model_version(REGISTERED_MODEL, version).tags["certification.run_id"]
    return run_id, json.load(open(mlflow.artifacts.download_artifacts(run_id=run_id,
                                                                      artifact_path="certification.json")))


def test_the_expert_set_that_chose_a_checkpoint_does_not_certify_it(tiny_world, tmp_path, monkeypatch):
    gold = WorldPaths.at(tiny_world).expert_set
    watched = {"watch_every": 10, "watch_gold": gold, "watch_gold_sha256": content_sha256(gold)}
    plain, _ = _register(tiny_world, **watched, select="final")          # the watch looked, the final was registered
    chosen, train_run = _register(tiny_world, **watched, select="watch_proposal")
    assert SEL.chosen_on(plain) is None
    assert SEL.chosen_on(chosen) == {"by": "the watch (watch_proposal)", "train_run": train_run,
                                     "expert_set_sha256": content_sha256(gold), "expert_set": gold}
    # the same policy: as trained, the expert set certifies it; chosen on it, no family
    assert _run("certify", "--model-version", plain, "--world", tiny_world).exit_code == 0
    _, report = _certification(plain)
    assert report["balanced"]["certifiable"] and "chosen_on" not in report
    res = _run("certify", "--model-version", chosen, "--world", tiny_world)
    assert res.exit_code == 0, res.output
    run_id, report = _certification(chosen)
    assert report["chosen_on"]["train_run"] == train_run and report["config"]["chosen_on_expert_set"] is True
    assert not any(r["certifiable"] for r in report["families"].values())
    assert {r["reason"] for r in report["families"].values()} == {CHOSEN_ON}
    md = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="certification.md")
    assert "winner's curse" in open(md).read()
    assert mlflow.MlflowClient().get_run(run_id).data.params["certify.chosen_on_expert_set"] == "true"

    # a certification that counted the expert set anyway (as certify did before this rule): release refuses it
    with monkeypatch.context() as m:
        m.setattr(SEL, "chosen_on", lambda version: None)
        assert _run("certify", "--model-version", chosen, "--world", tiny_world).exit_code == 0
    forged, report = _certification(chosen)
    assert report["balanced"]["certifiable"]
    res = _run("release", "--model-version", chosen, "--certification-run", forged, "--guardrails", LENIENT)
    assert res.exit_code != 0 and "winner's curse" in res.output, res.output
    aliases = mlflow.MlflowClient().get_registered_model(REGISTERED_MODEL).aliases
    assert aliases.get("champion") is None

    # labels on its own samples certify it, with no weight on the expert set, and release takes that
    labels = _labelled(tiny_world, chosen, tmp_path, per_family=4)
    res = _run("certify", "--model-version", chosen, "--world", tiny_world, "--policy-labels", labels,
               "--min-labels", 4)
    assert res.exit_code == 0, res.output
    run_id, report = _certification(chosen)
    rows = report["families"].values()
    assert all(r["method"] == "ppi" and r["evidence_weights"] == {"policy_labels": 1.0} for r in rows)
    res = _run("release", "--model-version", chosen, "--certification-run", run_id, "--guardrails", GATES)
    assert res.exit_code == 0 and "winner's curse" not in res.output, res.output


def test_a_run_whose_watch_chose_nothing_or_that_is_gone(tiny_world):
    gold = WorldPaths.at(tiny_world).expert_set
    sha = content_sha256(gold)
    off, _ = _register(tiny_world, watch_every=0, watch_gold_sha256=sha, select="watch_best")   # no watch ran
    older, _ = _register(tiny_world, watch_every=10, watch_gold_sha256=sha, early_stop="stop")  # before `select`
    assert SEL.chosen_on(off) is None
    assert SEL.chosen_on(older)["by"] == "the watch (early_stop=stop)"
    client = mlflow.MlflowClient()
    gone = client.create_model_version(REGISTERED_MODEL, "runs:/0123456789abcdef/policy", run_id="0123456789abcdef")
    with pytest.raises(Exception, match="how its checkpoint was chosen"):
        SEL.chosen_on(gone.version)


def _write(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_the_same_answers_in_another_file_are_the_same_expert_set(tiny_world, tmp_path):
    rows = D.read_jsonl(WorldPaths.at(tiny_world).expert_set, labelled=True)
    half_a, half_b = rows[::2], rows[1::2]
    a = _write(tmp_path / "a.jsonl", half_a)
    chosen = {"by": "the watch", "train_run": "r", "expert_set_sha256": content_sha256(a), "expert_set": a}
    assert SEL.reuses(chosen, a)
    assert SEL.reuses(chosen, _write(tmp_path / "a_reordered.jsonl", half_a[::-1]))
    relabelled = [{**r, "label": round(r["label"] + 0.01, 4)} for r in half_a[:5]] + half_b
    assert SEL.reuses(chosen, _write(tmp_path / "mixed.jsonl", relabelled))
    table = [{"id": r["id"], "family": r["family"], "attrs": r["attrs"], "response": " ".join(r["response"]),
              "label": r["label"], "score": 0.0} for r in half_a[:3]]
    assert SEL.reuses(chosen, _write(tmp_path / "table.jsonl", table), table=True)
    assert not SEL.reuses(chosen, _write(tmp_path / "b.jsonl", half_b))      # other answers: evidence again
    _write(a, half_a[:-1])                                                     # the choosing file changed since
    assert SEL.reuses(chosen, tmp_path / "b.jsonl")                           # cannot be compared: not counted


def test_certify_table_of_a_chosen_version_counts_only_its_labels(tiny_world, tmp_path):
    """The expert set exported as a table (scores and log-probs beside each answer: another file, the same
    answers) does not certify a checkpoint it chose either; the labelled families stand."""
    from test_certify_table import _labels, export_tables
    world = WorldPaths.at(tiny_world)
    watched = {"watch_every": 10, "watch_gold": world.expert_set, "watch_gold_sha256": content_sha256(world.expert_set)}
    chosen, _ = _register(tiny_world, **watched, select="watch_best")
    labels = _labels(world.policy, world, 20, tmp_path / "labels.jsonl")
    half = D.read_jsonl(labels, labelled=True)
    _write(labels, [r for r in half if r["family"] in ("anvil", "birch")])           # labels in two families only
    tables = export_tables(world.policy, world, labels, tmp_path)
    res = _run("certify-table", "--samples", tables["samples"], "--labels", tables["labels"], "--expert-set",
               tables["expert_set"], "--model-version", chosen)
    assert res.exit_code == 0, res.output
    run_id, report = _certification(chosen)
    assert report["chosen_on"]["by"] == "the watch (watch_best)" and report["config"]["chosen_on_expert_set"]
    rows = report["families"]
    assert {f for f, r in rows.items() if r["certifiable"]} == {"anvil", "birch"}
    assert all(rows[f]["evidence_weights"] == {"policy_labels": 1.0} for f in ("anvil", "birch"))
    assert {rows[f]["reason"] for f in ("cobalt", "dune", "ember", "fjord")} == {CHOSEN_ON}
