"""Certification on a real (tiny) world: the contract, the identity case, refusal without overlap."""
from __future__ import annotations

import json
import os

import pytest
import torch

from rlhf_mlflow.cli import portable
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.evidence import certify
from rlhf_mlflow.evidence.overlap import weight_support


def sharpened(world: str, out: str, factor: float = 12.0) -> str:
    """The reference with its output logits multiplied: the same modes, almost no overlap."""
    policy, cfg = M.load_policy(os.path.join(world, "policy"))
    with torch.no_grad():
        policy.head.weight.mul_(factor)
    M.save_policy(policy, cfg, out)
    return out


def _paths(world):
    return os.path.join(world, "policy"), os.path.join(world, "data", "gold_calib.jsonl")


def test_reference_certified_against_itself_recovers_the_expert_mean(tiny_world):
    ref, gold = _paths(tiny_world)
    report = certify.certify(ref, ref, gold, rm_dir=os.path.join(tiny_world, "reward_model"))
    labels = D.group_by_family(D.read_jsonl(gold, labelled=True))
    for f, row in report["families"].items():
        mean = sum(r["label"] for r in labels[f]) / len(labels[f])
        assert row["certifiable"] and row["reason"] == "ok"
        assert row["ess"] == pytest.approx(len(labels[f]))          # all weights equal
        assert row["pop_ess"] == pytest.approx(len(labels[f]), rel=1e-4)  # own samples' weights are 1 too
        assert row["snips"] == pytest.approx(mean)
        assert row["reference"] == pytest.approx(mean)
        assert row["kl"] == pytest.approx(0.0, abs=1e-4)
        assert row["lo"] <= row["estimate"] <= row["hi"]
        assert row["method"] == "doubly_robust"
        assert abs(row["estimate"] - mean) < 0.06                   # DR differs only by calibration noise
    bal = report["balanced"]
    assert bal["certifiable"] and bal["gain_lo"] <= 0.0 <= bal["gain_hi"]


def test_a_policy_without_overlap_is_refused_not_estimated(tiny_world, tmp_path):
    ref, gold = _paths(tiny_world)
    far = sharpened(tiny_world, str(tmp_path / "far"))
    report = certify.certify(far, ref, gold)
    refused = [f for f, r in report["families"].items() if not r["certifiable"]]
    assert refused, report["families"]
    for f in refused:
        row = report["families"][f]
        assert row["estimate"] is None and row["lo"] is None and row["gain"] is None
        assert "ESS" in row["reason"] or "k-hat" in row["reason"]
    assert not report["balanced"]["certifiable"] and report["balanced"]["estimate"] is None
    assert "not certifiable" in report["balanced"]["reason"]


def test_portable_cli_writes_the_contract(tiny_world, tmp_path):
    ref, gold = _paths(tiny_world)
    out = tmp_path / "cert.json"
    assert portable.certify_main(["--policy", ref, "--reference", ref, "--gold", gold, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for row in list(report["families"].values()) + [report["balanced"]]:
        for key in ("certifiable", "estimate", "lo", "hi", "reference"):
            assert key in row
    for row in report["families"].values():
        assert {"ess", "reason"} <= set(row)


def test_bad_input_is_a_clear_error(tiny_world, tmp_path):
    ref, gold = _paths(tiny_world)
    bad = tmp_path / "gold.jsonl"
    bad.write_text('{"id": "g", "family": "dune", "attrs": [0, 1, 2, 3], "response": ["pa"], "label": 0.5}\n')
    with pytest.raises(InputError, match=r"gold.jsonl:1: 'response' must be a list of 8 tokens"):
        certify.certify(ref, ref, str(bad))
    assert portable.certify_main(["--policy", str(tmp_path / "nope"), "--reference", ref, "--gold", gold,
                         "--out", str(tmp_path / "o.json")]) == 2
    with pytest.raises(InputError, match="n_boot"):
        CertifyConfig(n_boot=5)


def test_weight_support_agrees_with_certify_without_reading_labels(tiny_world, tmp_path):
    ref, gold = _paths(tiny_world)
    far = sharpened(tiny_world, str(tmp_path / "far"))
    rows = D.read_jsonl(gold, labelled=True)
    unlabelled = [{**r, "label": None} for r in rows]  # labels are not looked at
    report = certify.certify(far, ref, gold)
    support = weight_support(M.load_policy(far)[0], M.load_policy(ref)[0], unlabelled)
    assert set(support) == set(report["families"])
    for f, s in support.items():
        row = report["families"][f]
        assert s["ess"] == pytest.approx(row["ess"]) and s["certifiable"] == row["certifiable"]
        assert s["pop_ess"] == pytest.approx(row["pop_ess"])  # the same policy samples as certify's
        assert s["reason"] == row["reason"]


def test_population_ess_refuses_what_the_expert_rows_cannot_see(tiny_world, tmp_path):
    """A family whose expert-row ESS and k-hat pass but whose policy samples say the weights' second
    moment is too large (population ESS below the bar) is refused, and the reason says so."""
    ref, gold = _paths(tiny_world)
    mild = sharpened(tiny_world, str(tmp_path / "mild"), factor=1.6)
    rows = certify.certify(mild, ref, gold)["families"]
    # a family where the rows look healthier than the policy's own samples say
    f, row = max(rows.items(), key=lambda kv: kv[1]["ess"] - kv[1]["pop_ess"])
    assert row["pop_ess"] < row["ess"], rows
    bar = (row["pop_ess"] + row["ess"]) / 2
    cfg = CertifyConfig(min_ess=bar, max_khat=10.0)
    again = certify.certify(mild, ref, gold, cfg=cfg)["families"][f]
    assert not again["certifiable"] and again["estimate"] is None
    assert again["reason"].startswith("population ESS"), again["reason"]
