"""Release guardrails as a pure function of certification reports."""
from __future__ import annotations

import copy

import pytest

from dataclasses import asdict

from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.vocab import FAMILIES
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.decisions.guardrails import NAMES, GuardrailConfig, evaluate, non_default, non_default_tag

FAMS = list(FAMILIES)


def report(gain=0.08, kl=1.0, ess=40.0, shortcut=(0.2, 0.3)) -> dict:
    fams = {}
    for f in FAMS:
        fams[f] = {"certifiable": True, "reason": "ok", "ess": ess, "kl": kl, "reference": 0.27,
                   "estimate": 0.27 + gain, "gain": gain, "shortcuts": []}
    fams["dune"]["shortcuts"] = [{"family": "dune", "kind": "token", "token": "pa",
                                  "reference_count": shortcut[0], "policy_count": shortcut[1]}]
    bal = {"certifiable": True, "reason": "ok", "reference": 0.27, "estimate": 0.27 + gain, "gain": gain,
           "gain_lo": gain - 0.03, "gain_hi": gain + 0.03, "lo": 0.24 + gain, "hi": 0.30 + gain}
    rules = [{"family": "dune", "kind": "token", "token": "pa"}]
    return {"families": fams, "balanced": bal, "config": asdict(CertifyConfig()), "input_sha256": {"gold": "ab" * 32},
            "shortcut_rules": rules}


def failed(results):
    return {k for k, (ok, _) in results.items() if not ok}


def test_a_good_candidate_passes_every_guardrail():
    results = evaluate(report())
    assert set(results) == set(NAMES)
    assert failed(results) == set()
    assert all(isinstance(why, str) and why for _, why in results.values())


def test_each_guardrail_fails_on_its_own_condition():
    r = report(gain=0.01)
    assert failed(evaluate(r)) == {"balanced_gain"}
    r = report()
    r["families"]["dune"]["gain"] = -0.05
    results = evaluate(r)
    assert failed(results) == {"family_change"} and "dune" in results["family_change"][1]
    assert failed(evaluate(report(kl=6.5))) == {"family_kl"}
    assert not failed(evaluate(report(kl=5.5)))  # drift below the cap: certified from labels, it passes
    results = evaluate(report(shortcut=(0.2, 3.1)))
    assert failed(results) == {"marker_collapse"} and "pa" in results["marker_collapse"][1]
    r = report()
    r["balanced"]["gain_lo"] = -0.01
    assert failed(evaluate(r)) == {"balanced_gain"}
    assert failed(evaluate(r, GuardrailConfig(require_significant_gain=False))) == set()


def test_refused_certification_fails_certifiable_and_the_gains():
    r = report()
    r["families"]["dune"].update(certifiable=False, reason="ESS 3.0 < 10 of 100", estimate=None, gain=None, ess=3.0)
    r["balanced"].update(certifiable=False, reason="not certifiable: dune", estimate=None, gain=None)
    results = evaluate(r)
    assert {"certifiable", "balanced_gain", "family_change"} <= failed(results)
    assert "dune" in results["certifiable"][1]


def test_a_candidate_must_beat_the_champion():
    champion = report(gain=0.10)
    assert failed(evaluate(report(gain=0.08), champion=champion)) == {"beats_champion"}
    assert failed(evaluate(report(gain=0.12), champion=champion)) == set()
    refused = copy.deepcopy(champion)
    refused["balanced"]["certifiable"] = False
    assert "beats_champion" in failed(evaluate(report(), champion=refused))


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(InputError, match=r"unknown guardrail key 'max_kl'; valid keys are \[.*max_family_kl"):
        GuardrailConfig.from_dict({"max_kl": 3})
    assert GuardrailConfig.from_dict({"max_family_kl": "4", "require_significant_gain": "false"}) == \
        GuardrailConfig(max_family_kl=4.0, require_significant_gain=False)
    with pytest.raises(InputError, match="min_ess"):
        GuardrailConfig.from_dict({"min_ess": "0"})
    with pytest.raises(InputError, match="must be a number"):
        GuardrailConfig.from_dict({"min_ess": "many"})


def test_min_ess_is_certifys_threshold_read_back_not_a_second_one():
    """Regression: after `certify --min-ess 5`, a family with ESS 7 is certifiable; release used to
    refuse it as "not certifiable: dune (ok)" by comparing its own min_ess to the family's ESS."""
    r = report(ess=7.0)
    r["config"]["min_ess"] = 5.0
    ok, why = evaluate(r, GuardrailConfig())["certifiable"]
    assert not ok and "certified with min_ess 5, below the 10 required" in why and "(ok)" not in why
    assert evaluate(r, GuardrailConfig(min_ess=5.0))["certifiable"][0]
    r["config"]["min_ess"] = 10.0
    assert evaluate(r, GuardrailConfig())["certifiable"] == (True, "every family certifiable (min_ess 10), min ESS 7.0")


@pytest.mark.parametrize("key, value", [("max_khat", 5.0), ("min_labels", 2), ("level", 0.5), ("ess_widening", 0.0),
                                        ("label_widening", 1.0), ("family_correlation", 0.0)])
def test_a_looser_certification_is_refused_not_rejudged(key, value):
    """`certify --max-khat 5` or `--min-labels 2` then a default release: its families were certified by a
    looser rule than release's, so certifiable fails naming the threshold (and every guardrail reads it)."""
    r = report()
    r["config"][key] = value
    ok, why = evaluate(r)["certifiable"]
    assert not ok and f"certified with {key} {value:g}" in why
    assert non_default(GuardrailConfig(), r["config"]) == [f"certify.{key}={value:g}"]
    if key in ("max_khat", "min_labels"):  # loosened at release, in the open
        assert evaluate(r, GuardrailConfig(**{key: value}))["certifiable"][0]


def test_a_report_that_does_not_state_a_threshold_is_refused():
    r = report()
    del r["config"]["max_khat"]
    ok, why = evaluate(r)["certifiable"]
    assert not ok and "max_khat unstated" in why


def test_the_champion_is_compared_only_on_the_same_expert_set():
    champion = report(gain=0.02)
    champion["input_sha256"] = {"gold": "cd" * 32}
    ok, why = evaluate(report(gain=0.3), champion=champion)["beats_champion"]
    assert not ok and "not made on the same expert set" in why
    champion["input_sha256"] = {"gold": "ab" * 32}
    assert evaluate(report(gain=0.3), champion=champion)["beats_champion"][0]


def test_non_default_names_every_changed_threshold():
    assert non_default(GuardrailConfig(), asdict(CertifyConfig())) == []
    cfg = GuardrailConfig.from_dict({"min_balanced_gain": "-1", "require_significant_gain": "false", "min_labels": "30"})
    assert non_default(cfg) == ["min_balanced_gain=-1", "require_significant_gain=false", "min_labels=30"]


# guardrails fail closed --------------------------------------------------------------------------

def test_missing_evidence_is_unknown_and_refuses():
    """No diagnostic (no shortcut rules), a family the report does not cover, one deployment does not
    know, a KL never measured: each guardrail reading it fails with `unknown: ...`."""
    r = report()
    r["shortcut_rules"] = None
    for f in r["families"].values():
        f["shortcuts"] = []
    ok, why = evaluate(r)["marker_collapse"]
    assert not ok and why.startswith("unknown: no diagnostic")
    r = report()
    del r["families"]["ember"]
    results = evaluate(r)
    assert {"certifiable", "family_change", "family_kl"} <= failed(results)
    assert results["certifiable"][1] == "unknown: no evidence for ember"
    r = report()
    r["families"]["quartz"] = copy.deepcopy(r["families"]["anvil"])
    assert "families deployment does not have: quartz" in evaluate(r)["certifiable"][1]
    r = report()
    r["families"]["birch"]["kl"] = None
    ok, why = evaluate(r)["family_kl"]
    assert not ok and why.startswith("unknown: no KL measured for birch")


def test_a_waiver_passes_missing_evidence_only_and_is_non_default():
    r = report(kl=6.5)
    r["shortcut_rules"] = None
    waived = GuardrailConfig.from_dict({"waive": "marker_collapse+family_kl"})
    results = evaluate(r, waived)
    assert results["marker_collapse"] == (True, "waived (unknown: no diagnostic: the certification counted no "
                                                "flagged shortcut (certify --diagnostic F))")
    assert not results["family_kl"][0] and "KL above 6" in results["family_kl"][1]  # measured and too far: fails
    assert non_default(waived) == ["waive=marker_collapse+family_kl"]
    with pytest.raises(InputError, match="'beats_champion' cannot be waived; waivable guardrails"):
        GuardrailConfig.from_dict({"waive": "beats_champion"})


def test_the_non_default_tag_fits_the_registry_list():
    loosened = ["min_balanced_gain=-1", "require_significant_gain=false", "min_family_change=-1", "max_khat=5",
                "certify.max_khat=5"]
    assert non_default_tag(loosened) == "gain,sig,change+2"
    assert len("non_default: " + non_default_tag(loosened)) <= 30
    assert non_default_tag(["max_khat=5", "certify.max_khat=5"]) == "khat,c.khat"
    assert non_default_tag([]) is None
