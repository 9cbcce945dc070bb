"""The `release` step: promote a version to `champion` only if every guardrail passes.

The certification is verified before anything else (its provenance in tracking/registry.py, then
recomputed from its inputs where they are on this machine); the champion read, the guardrails and the
alias move then happen under the registry's release lock (tracking/release_lock.py), so concurrent
releases decide one after another. Every result is written as a version tag before the alias moves."""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.decisions import certify as C
from rlhf_mlflow.decisions import guardrails as G
from rlhf_mlflow.steps.reports import (
    guardrails_markdown,
    release_markdown,
    verdict_markdown,
)
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.release_lock import ReleaseLock


def run_release(version: str, certification_run: str | None = None, guardrails: dict | None = None,
                echo: Callable[[str], None] = print, lock_wait: float = 600.0) -> dict:
    """Evaluate the guardrails for `version`; promote it to champion only if every one passes.

    The certification is checked before anything else (provenance, then recomputed from its inputs
    where they are on this machine); the champion read, the guardrails and the alias move then happen
    under the registry's release lock, so concurrent releases decide one after another."""
    cfg = G.GuardrailConfig.from_dict(guardrails or {})
    params = {"model_version": version, "certification_run": certification_run,
              **{f"guardrail.{k}": v for k, v in cfg.to_dict().items()}}
    with T.tracked_run("release", params, run_name=f"release-v{version}") as run:
        mv = REG.get_version(version)
        cert_run, report = REG.certification_for(mv, certification_run)
        evidence = recompute_certification(report, mv, cert_run)
        echo(f"release version {mv.version}: certification {cert_run} {evidence}")
        with ReleaseLock(REG.REGISTERED_MODEL, run.info.run_id, wait_seconds=lock_wait) as lock:
            current = REG.champion_version()
            is_champion = current is not None and current.version == mv.version
            champion_report = None if current is None or is_champion else REG.champion_certification(current)
            results = G.evaluate(report, cfg, champion_report)
            if is_champion:
                results["beats_champion"] = (True, "already the champion")
            passed = all(ok for ok, _ in results.values())
            decision = "promoted" if passed else "refused"
            before = current.version if current else None
            T.log_metrics({f"{MN.RELEASE}guardrail/{k}": float(ok) for k, (ok, _) in results.items()}
                          | {MN.RELEASE + "promoted": float(passed)})
            T.log_text(release_markdown(mv.version, results, decision, before), "release.md")
            T.log_json_artifact({"model_version": mv.version, "certification_run": cert_run, "evidence": evidence,
                                 "decision": decision, "champion_before": before,
                                 "guardrails": {k: {"pass": ok, "reason": why} for k, (ok, why) in results.items()},
                                 "config": cfg.to_dict()}, "release.json")
            lock.check()
            # every result is on the version before the alias can move
            REG.set_tags(mv.version, {**{f"guardrail.{k}": f"{'pass' if ok else 'fail'}: {why}"
                                         for k, (ok, why) in results.items()},
                                      "release.decision": "promoting" if passed else "refused",
                                      "release.run_id": run.info.run_id, "release.evidence": evidence,
                                      "release.certification_run_id": cert_run,
                                      "release.certification_sha256": mv.tags.get("certification.sha256", "")})
            if passed:
                REG.move_champion(mv.version)
                REG.set_tags(mv.version, {"release.decision": "promoted", "release.previous_champion": before or "none",
                                          "release.promoted_at": f"{time.time():.3f}"})
        _describe(mv, results, decision, report, cfg)
        failed = [k for k, (ok, _) in results.items() if not ok]
        echo(f"release version {mv.version}: {decision}" + (f" (failed: {', '.join(failed)})" if failed else
                                                            " -> models:/rlhf-policy@champion"))
    return {"run_id": run.info.run_id, "decision": decision, "guardrails": results, "certification_run": cert_run}


def _describe(mv, results: dict, decision: str, report: dict, cfg: G.GuardrailConfig) -> None:
    """Where people look: the verdict on the version's description and on its training run's tags,
    the guardrails on the registered model's description (words only: the decision is in the tags)."""
    REG.describe(mv.version, verdict_markdown(mv.version, results, decision, report))
    REG.describe(None, guardrails_markdown(cfg.to_dict(), mv.version))
    if mv.run_id:
        T.tag_run(mv.run_id, {"rlhf.release_decision": decision, "rlhf.model_version": str(mv.version)})


COMPARED = ("certifiable", "estimate", "lo", "hi", "gain", "gain_lo", "gain_hi", "ess", "kl")
TOLERANCE = 1e-3  # float summation order differs between thread counts; a doctored number is far off


def recompute_certification(report: dict, version, run_id: str) -> str:
    """Recompute the certification from the inputs it names and compare it with the report; raise
    InputError on a mismatch. Returns "recomputed", or why it could not be (its inputs are not on this
    machine, or differ from those it hashed), which release then records beside its decision."""
    inputs, hashes = report.get("inputs", {}), report.get("input_sha256", {})
    absent = [k for k, path in inputs.items() if path and k != "policy"
              and (not os.path.exists(path) or hashes.get(k) != content_sha256(path))]
    if absent or not inputs.get("reference") or not inputs.get("gold"):
        return "checked (provenance only: not recomputed, inputs not on this machine as certified: " + \
            ", ".join(absent or ["reference/gold"]) + ")"
    policy_dir, _ = REG.download_policy(version.version)
    fresh = C.certify(policy_dir, inputs["reference"], inputs["gold"], rm_dir=inputs.get("rm_dir"),
                      correction=inputs.get("correction"), pilot_prompts=inputs.get("pilot_prompts"),
                      cfg=_certify_config(report), shortcuts=report.get("shortcut_rules") or [],
                      policy_labels=inputs.get("policy_labels"))
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
    return "recomputed"


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
    and 17) has no `ess_widening` / `label_widening`, one before estimator 5 no `family_correlation`, and
    was certified without them."""
    return C.CertifyConfig(**{"ess_widening": 0.0, "label_widening": 1.0, "family_correlation": 0.0,
                              **report.get("config", {})})
