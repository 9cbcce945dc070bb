"""Labels bought in rounds: each look's interval is paid for, and the look comes from the store
(tracking/label_looks.py), not from the user: a spending rule's share per look, or a union bound."""
from __future__ import annotations

import json
import os

import mlflow
import pytest
from test_certify import sharpened
from test_labels import LENIENT, _labelled, _register, _run

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.decisions.labelled import half_width
from rlhf_mlflow.decisions.policy_labels import label_rule
from rlhf_mlflow.decisions.sequential import spending_shares
from rlhf_mlflow.steps.main.labels import could_beat_champion
from rlhf_mlflow.tracking.policy_model import REGISTERED_MODEL

SPENDING = "0.7,0.1,0.1,0.1"
LOOKS = ("--label-spending", SPENDING, "--min-labels", 4)
GATES = LENIENT + ",min_labels=4"


def test_a_spending_rule_gives_each_look_its_share_of_the_error_budget():
    rule = lambda look: label_rule(CertifyConfig(label_spending=SPENDING, label_look=look))  # noqa: E731
    union4 = half_width(1.0, 20, 0.90, 4)
    assert half_width(1.0, 20, 0.90, rule(1).looks) < 0.8 * union4   # look 1: 0.07 of the 0.10, not 0.025
    assert half_width(1.0, 20, 0.90, rule(2).looks) > union4         # later looks: 0.01 each
    assert half_width(1.0, 20, 0.90, rule(1).looks) > half_width(1.0, 20, 0.90, 1)
    assert label_rule(CertifyConfig(label_looks=4)).looks == 4       # no rule: the union bound as before
    for bad in ("0.7,0.4", "0,1", "nan", "0.5,x", ",".join(["0.0001"] * 1001)):
        with pytest.raises(InputError, match="label_spending"):
            spending_shares(bad)
    with pytest.raises(InputError, match="allows 4 looks"):
        CertifyConfig(label_spending=SPENDING, label_look=5)


def _certify(version, world, labels, *extra):
    res = _run("certify", "--model-version", version, "--world", world, "--policy-labels", labels, *extra)
    assert res.exit_code == 0, res.output
    client = mlflow.MlflowClient()
    run_id = client.get_model_version(REGISTERED_MODEL, version).tags["certification.run_id"]
    path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="certification.json")
    return run_id, json.load(open(path))


def test_each_new_labels_file_is_the_next_look_and_release_counts_again(tiny_world, tmp_path):
    v = _register(sharpened(tiny_world, str(tmp_path / "far")))
    os.makedirs(tmp_path / "a"), os.makedirs(tmp_path / "b")
    first = _labelled(tiny_world, v, tmp_path / "a", per_family=4)   # few labels: the looks are what is tested
    run1, report = _certify(v, tiny_world, first, *LOOKS)
    assert report["config"]["label_look"] == 1
    run1b, report = _certify(v, tiny_world, first, *LOOKS)   # the same labels again: the same look
    assert report["config"]["label_look"] == 1
    more = _labelled(tiny_world, v, tmp_path / "b", per_family=6)    # a round more
    run2, report = _certify(v, tiny_world, more, *LOOKS)
    assert report["config"]["label_look"] == 2
    looks = [r["ppi"]["looks"] for r in report["families"].values() if r.get("ppi")]
    assert looks and all(x == pytest.approx(10.0) for x in looks)   # look 2's share: 0.1 of the budget
    # a union bound over one look cannot be claimed at the second: refused before any run
    runs_before = len(mlflow.search_runs(search_all_experiments=True, output_format="list"))
    res = _run("certify", "--model-version", v, "--world", tiny_world, "--policy-labels", more, "--min-labels", 4)
    assert res.exit_code != 0 and "not valid at look 2" in res.output, res.output
    assert len(mlflow.search_runs(search_all_experiments=True, output_format="list")) == runs_before
    res = _run("release", "--model-version", v, "--certification-run", run2, "--guardrails", GATES)
    assert res.exit_code == 0 and "look" not in res.output, res.output     # recounted: look 2, as certified
    # main buys labels for a later candidate only if its reward model's estimate clears this champion's lower bound
    lo = report["balanced"]["lo"]
    weights = {f: 1 / len(V.FAMILIES) for f in V.FAMILIES}
    guess = lambda v: {"families": {f: {"estimate": None, "doubly_robust": v} for f in V.FAMILIES},  # noqa: E731
                       "balanced": {"weights": weights}}
    worth, why = could_beat_champion(guess(lo - 0.01))
    assert not worth and f"champion v{v}'s certified lower bound {lo:.3f}" in why
    assert could_beat_champion(guess(lo + 0.01)) == (True, "")
    # a candidate of this round that labels certified with every guardrail passing raises the bar before release
    worth, why = could_beat_champion(guess(lo + 0.01), {"v7 (this round)": lo + 0.02})
    assert not worth and f"v7 (this round)'s certified lower bound {lo + 0.02:.3f}" in why
    assert could_beat_champion(guess(lo + 0.03), {"v7 (this round)": lo + 0.02}) == (True, "")
    # a certify run of this version with other labels that started before look 1 (as a concurrent one would),
    # in an experiment deleted since: the store still makes `more` look 3, and release refuses the report
    # that says 2
    client = mlflow.MlflowClient()
    started = client.get_run(run1).info
    hidden = client.create_experiment("hidden")
    ghost = client.create_run(hidden, start_time=started.start_time - 1, tags={"rlhf.step": "certify"})
    client.log_param(ghost.info.run_id, "model_version", v)
    client.log_param(ghost.info.run_id, "policy_labels_sha256", "f" * 64)
    client.delete_experiment(hidden)
    res = _run("release", "--model-version", v, "--certification-run", run2, "--guardrails", GATES)
    assert res.exit_code != 0 and "look 2" in res.output and "look 3" in res.output, res.output
