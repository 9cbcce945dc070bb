"""The `release` step: promote a version to `champion` only if every guardrail passes.

The certification is verified before anything else (its provenance in tracking/registry.py, then
recomputed from its inputs where they are on this machine); the champion read, the guardrails and the
alias move then happen under the registry's release lock (tracking/release_lock.py), so concurrent
releases decide one after another. The decision is on the version (tags `release.decision`,
`release.run_id`) before the alias moves; the champion it replaced then says superseded, and the
descriptions are written, still under the lock."""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import WORLD_INPUTS
from rlhf_mlflow.decisions import certify as C
from rlhf_mlflow.decisions import guardrails as G
from rlhf_mlflow.steps import selection as SEL
from rlhf_mlflow.steps.certify import RULES_PARAM, rules_sha256, world_input_problem
from rlhf_mlflow.decisions.table_certify import table_report
from rlhf_mlflow.evidence import certify as EC
from rlhf_mlflow.steps.reports import (
    failed_tags,
    gate_markdown,
    release_markdown,
    superseded_markdown,
    verdict_markdown,
)
from rlhf_mlflow.tracking import label_looks as LL
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking import world_record as WR
from rlhf_mlflow.tracking.release_lock import ReleaseLock


def run_release(version: str, certification_run: str | None = None, guardrails: dict | None = None,
                echo: Callable[[str], None] = print, lock_wait: float = 600.0, trust_remote: bool = False) -> dict:
    """Evaluate the guardrails for `version`; promote it to champion only if every one passes.

    The certification is checked before anything else (provenance, then recomputed from its inputs;
    inputs not on this machine are refused unless `trust_remote`); the champion read, the guardrails,
    the alias move, the superseded champion and the descriptions then happen under the registry's
    release lock, so concurrent releases decide one after another. Thresholds other than the defaults
    are written on the version's description."""
    cfg = G.GuardrailConfig.from_dict(guardrails or {})
    params = {"model_version": version, "certification_run": certification_run, "trust_remote_evidence": trust_remote,
              **{f"guardrail.{k}": v for k, v in cfg.to_dict().items()}}
    with T.tracked_run("release", params, run_name=f"release-v{version}") as run:
        mv = REG.get_version(version)
        cert_run, report = REG.certification_for(mv, certification_run)
        evidence = recompute_certification(report, mv, cert_run, trust_remote)
        echo(f"release version {mv.version}: certification {cert_run} {evidence}")
        loosened = G.non_default(cfg, report.get("config"))
        pinned = {REG.PINNED[0]: cert_run, REG.PINNED[1]: mv.tags.get("certification.sha256", "")}
        T.log_params(pinned)  # what the champion is compared by: a run's parameters cannot change
        with ReleaseLock(REG.REGISTERED_MODEL, run.info.run_id, wait_seconds=lock_wait) as lock:
            current = REG.champion_version()
            is_champion = current is not None and current.version == mv.version
            champion_report = None if current is None or is_champion else _champion_report(current, report,
                                                                                           trust_remote)
            results = G.evaluate(report, cfg, champion_report)
            if is_champion:
                results["beats_champion"] = (True, "already the champion")
            passed = all(ok for ok, _ in results.values())
            decision = "promoted" if passed else "refused"
            before = current.version if current else None
            T.log_metrics({MN.RELEASE + "promoted": float(passed),  # which failed: release.json, the description
                           MN.RELEASE + "guardrails_failed": sum(not ok for ok, _ in results.values())})
            T.log_text(release_markdown(mv.version, results, decision, before), "release.md")
            T.log_json_artifact({"model_version": mv.version, "certification_run": cert_run, "evidence": evidence,
                                 "decision": decision, "champion_before": before, "non_default": loosened,
                                 "guardrails": {k: {"pass": ok, "reason": why} for k, (ok, why) in results.items()},
                                 "config": cfg.to_dict(), "decided_at": round(time.time(), 3),
                                 "certification_sha256": pinned[REG.PINNED[1]]}, "release.json")
            lock.check()
            # the decision is on the version before the alias can move
            REG.set_tags(mv.version, {"release.decision": "promoting" if passed else "refused",
                                      "release.run_id": run.info.run_id})
            REG.set_failed(mv.version, failed_tags(results, report, REG.FAILED))
            REG.set_or_clear(mv.version, G.TAG, G.non_default_tag(loosened))
            if passed:
                REG.move_champion(mv.version)
                REG.set_tags(mv.version, {"release.decision": "promoted"})
                _supersede(mv.version, before)
            _describe(mv, results, decision, report, loosened, evidence, _links(run, cert_run),
                      mv if passed else current)
        failed = [k for k, (ok, _) in results.items() if not ok]
        echo(f"release version {mv.version}: {decision}" + (f" (failed: {', '.join(failed)})" if failed else
                                                            " -> models:/rlhf-policy@champion")
             + (f" under non-default thresholds: {', '.join(loosened)}" if loosened else ""))
    return {"run_id": run.info.run_id, "decision": decision, "guardrails": results, "certification_run": cert_run,
            "non_default": loosened}


def _champion_report(champion, candidate: dict, trust_remote: bool) -> dict:
    """The champion's certification to compare the candidate with: the one it was promoted on, or, when
    that was made on another expert set, its latest certification (checked and recomputed like the
    candidate's) if that one was made on the candidate's expert set. When neither was, the promoted
    one, which the guardrail then says it cannot compare."""
    promoted = REG.champion_certification(champion)
    wanted = G.expert_set_sha256(candidate)
    latest = champion.tags.get("certification.run_id")
    if G.expert_set_sha256(promoted) == wanted or not latest or latest == REG.pinned_certification(champion)[0]:
        return promoted
    run_id, report = REG.certification_for(champion, latest)
    if G.expert_set_sha256(report) != wanted:
        return promoted
    recompute_certification(report, champion, run_id, trust_remote)
    return report


def _supersede(champion: str, before: str | None) -> None:
    """Right after the alias moved to `champion` (under the release lock): every other version that
    still says promoted says superseded, by `champion` when it is the one the alias left, else naming
    today's champion; its description keeps the verdict it was promoted on below that."""
    for v in REG.versions_promoted():
        if str(v.version) == str(champion):
            continue
        direct = before is not None and str(v.version) == str(before)
        decision = f"superseded by v{champion}" if direct else f"superseded (champion now v{champion})"
        REG.set_tags(v.version, {"release.decision": decision})
        REG.describe(v.version, superseded_markdown(v.version, champion, v.description, direct))
        if v.run_id:
            T.tag_run(v.run_id, {"rlhf.release_decision": decision})


def _links(release_run, cert_run: str) -> list[str]:
    """Markdown links to the certify run and the release run (the UI's own `#/` routes)."""
    cert = T.get_run(cert_run)
    return [f"Certification: [{cert.info.run_name}](#/experiments/{cert.info.experiment_id}/runs/{cert_run})",
            f"release: [{release_run.info.run_name}](#/experiments/{release_run.info.experiment_id}/runs/"
            f"{release_run.info.run_id})"]


def _describe(mv, results: dict, decision: str, report: dict, loosened: list[str], evidence: str,
              links: list[str], champion) -> None:
    """Where people look: the verdict on the version's description (with any non-default threshold and
    evidence not recomputed) and on its training run's tags; the registered model's description names
    the champion, then the gate's account."""
    REG.describe(mv.version, verdict_markdown(mv.version, results, decision, report, loosened, evidence, links))
    REG.describe(None, gate_markdown(champion.version if champion else None,
                                     champion.tags.get("recipe") if champion else None))
    if mv.run_id:
        T.tag_run(mv.run_id, {"rlhf.release_decision": decision, "rlhf.model_version": str(mv.version)})


COMPARED = ("certifiable", "estimate", "lo", "hi", "gain", "gain_lo", "gain_hi", "ess", "kl")
TOLERANCE = 1e-3  # float summation order differs between thread counts; a doctored number is far off
INPUTS = ("reference", "gold", "rm_dir", "pilot_prompts", "correction", "policy_labels", "samples", "labels",
          "expert_set")
TRUST_FLAG = "--trust-remote-evidence"
IMPLS = ("policy_impl", "reward_impl")
"""Import paths of another implementation of the model protocol a certification ran with (not files:
compared with the certify run's parameters, and given to the recomputation)."""


def recompute_certification(report: dict, version, run_id: str, trust_remote: bool = False) -> str:
    """Recompute the certification from the inputs it names and compare it with the report; raise
    InputError on any difference. Before that, the report must name the inputs and thresholds the
    certify run's own (immutable) parameters name, and each input must be on this machine with the
    content it was certified with (files of the version's world as its training run recorded them).
    Inputs not on this machine are refused unless `trust_remote` (the flag TRUST_FLAG): then the
    certification is released on its provenance alone, and the returned words (recorded on the
    version) say so. Returns "recomputed" or those words."""
    refuse = f"certification run {run_id} refused for version {version.version}: "
    inputs, hashes = report.get("inputs", {}), report.get("input_sha256", {})
    run = T.get_run(run_id)
    problem = (_disagrees_with_params(report, run.data.params) or _look_problem(report, version, run)
               or SEL.reuse_problem(report, version))
    if problem:
        raise InputError(refuse + problem)
    needed = ("samples", "labels") if report.get("kind") == "table" else ("reference", "gold")
    if not all(inputs.get(k) for k in needed):
        raise InputError(refuse + f"its report names no {' or '.join(needed)} to recompute it from")
    absent = [k for k in INPUTS if inputs.get(k) and not os.path.exists(inputs[k])]
    changed = [f"{k} {inputs[k]}" for k in INPUTS if inputs.get(k) and k not in absent
               and hashes.get(k) != content_sha256(inputs[k])]
    if changed:
        raise InputError(refuse + f"its input {changed[0]} changed after it was certified (sha256 differs): certify "
                         "the version again on the inputs as they are")
    record = WR.version_record(version)
    for k in WORLD_INPUTS:
        if record and inputs.get(k) and k not in absent:
            wrong = world_input_problem(k, inputs[k], record)
            if wrong:
                raise InputError(refuse + f"its {k} is not the version's world's as its training run recorded "
                                 f"it: {wrong}")
    if absent:
        where = ", ".join(f"{k} {inputs[k]}" for k in absent)
        if not trust_remote:
            raise InputError(refuse + f"its inputs are not on this machine ({where}): release where they are, or "
                             f"pass {TRUST_FLAG} to release on its provenance alone (recorded on the version)")
        return f"provenance only ({TRUST_FLAG}): not recomputed, inputs not on this machine: {where}"
    _compare(report, _recomputed(report, version), version, run_id)
    return "recomputed"


def _disagrees_with_params(report: dict, params: dict) -> str | None:
    """Where a report's inputs, their hashes or its thresholds differ from what its certify run logged as
    parameters (a run's parameters cannot be changed once logged; an artifact can be replaced)."""
    def logged(key):  # under `mlflow run` the launcher logs the raw value and certify the resolved one
        return T.logged_param(params, key)
    inputs, hashes, config = report.get("inputs", {}), report.get("input_sha256", {}), report.get("config", {})
    for k in (*INPUTS, *IMPLS):
        said, ran = inputs.get(k), logged(k)
        if (said or None) != (ran or None):
            return f"its report names {k} {said}, its certify run's parameters {k} {ran}"
        if logged(f"{k}_sha256") is not None and hashes.get(k) != logged(f"{k}_sha256"):
            return f"its report's {k} sha256 is not the one its certify run logged"
    if params.get(RULES_PARAM) != rules_sha256(report.get("shortcut_rules")):
        return ("its report's shortcut rules are not the ones its certify run logged" if params.get(RULES_PARAM)
                else "its certify run logged no shortcut rules (certified before they were recorded): certify again")
    for k, v in config.items():
        ran = logged(f"certify.{k}")
        if ran is not None and _number(ran) != _number(v):
            return f"its report says it was certified with {k} {v}, its certify run's parameters {k} {ran}"
    return None


def _look_problem(report: dict, version, run) -> str | None:
    """Whether the look a report's labels were certified at is the look the store makes them
    (tracking/label_looks.py: the version's labelled certify runs up to this one's start, ties against it)."""
    sha = LL.labels_sha(run.data.params)
    cfg = report.get("config", {})
    if not sha or cfg.get("label_sequential"):
        return None
    look = LL.look_of(sha, LL.looks(version.version, until_ms=run.info.start_time, exclude_run=run.info.run_id))
    if cfg.get("label_spending"):
        if int(cfg.get("label_look", 1)) != look:
            return (f"it was certified as look {cfg.get('label_look', 1)} of the version's labels, the store's "
                    f"certify runs make it look {look}")
    elif look > int(cfg.get("label_looks", 1)):
        return (f"its labels are look {look} of the version's (the store's certify runs), its intervals are "
                f"union-bounded over {cfg.get('label_looks', 1)} looks")
    return None


def _number(v):
    if isinstance(v, str) and v.lower() in ("true", "false"):  # a bool as the tracking layer logs it
        return float(v.lower() == "true")
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def _recomputed(report: dict, version) -> dict:
    inputs = report["inputs"]
    if report.get("kind") == "table":  # a policy certified from its samples: from the same tables
        return table_report(inputs, _certify_config(report), report.get("shortcut_rules"), recorded_rules=True)
    policy_dir, _ = REG.download_policy(version.version)
    return EC.certify(policy_dir, inputs["reference"], inputs["gold"], rm_dir=inputs.get("rm_dir"),
                      correction=inputs.get("correction"), pilot_prompts=inputs.get("pilot_prompts"),
                      cfg=_certify_config(report), shortcuts=report.get("shortcut_rules"),
                      policy_labels=inputs.get("policy_labels"), policy_impl=inputs.get("policy_impl"),
                      reward_impl=inputs.get("reward_impl"))


def _compare(report: dict, fresh: dict, version, run_id: str) -> None:
    claimed, got = _comparable(report), _comparable(fresh)
    for key in sorted(claimed.keys() | got.keys()):
        a, b = claimed.get(key), got.get(key)
        if not (abs(a - b) <= TOLERANCE if isinstance(a, float) and isinstance(b, float) else a == b):
            written_by = report.get("estimator", "1 or 2")
            if written_by != C.ESTIMATOR_VERSION:
                raise InputError(f"certification run {run_id} refused for version {version.version}: it was written "
                                 f"by certify's estimator {written_by}, this release computes estimator "
                                 f"{C.ESTIMATOR_VERSION} and gets {key} {b} where the report says {a}: certify the "
                                 "version again")
            raise InputError(f"certification run {run_id} refused for version {version.version}: recomputed from "
                             f"its inputs, {key} is {b}, the report says {a}")


def _comparable(report: dict) -> dict:
    """{"<family> <field>": value} of what the guardrails read: estimates, intervals, gains, ESS, KL, and
    each flagged shortcut's counts."""
    out = {}
    for group, row in {**report["families"], "balanced": report["balanced"]}.items():
        for key in COMPARED:
            v = row.get(key)
            out[f"{group} {key}"] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        for s in row.get("shortcuts", []):
            for key in ("policy_count", "reference_count"):
                out[f"{group} {SR.describe(s)} {key}"] = float(s[key])
    return out


def _certify_config(report: dict) -> C.CertifyConfig:
    """The config a report was certified with; one written before the interval widenings (issues 19
    and 17) has no `ess_widening` / `label_widening`, one before estimator 5 no `family_correlation`, one
    before estimator 6 no `label_combine`, one before estimator 7 no `label_folds`, and was certified
    without them."""
    return C.CertifyConfig(**{"ess_widening": 0.0, "label_widening": 1.0, "family_correlation": 0.0,
                              "label_combine": False, "label_folds": 0, **report.get("config", {})})
