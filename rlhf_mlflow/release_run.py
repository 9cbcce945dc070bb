"""certify, release and grade as MLflow runs on registered policy versions.

certify  estimates the version's true quality from the expert set, logs `certified/<family>`, interval
         bounds, `ess/<family>`, gains, a markdown report and a figure, links the metrics to the
         version's LoggedModel and tags the version with the certify run.
release  reads exactly that version's certification, evaluates the guardrails against the current
         champion's certification, writes every result as a version tag, then (only if all pass)
         moves the `champion` alias.
grade    (synthetic worlds) logs the oracle's `truth/<family>` on its own run; release never reads it.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from . import certify as C
from . import guardrails as G
from .checkpoint import content_sha256
from .errors import InputError
from .files import atomic_write_json, check_writable
from .figures import certification_plot
from .reports import certification_markdown, release_markdown
from .reward_wrapper import load_wrapper
from .tracking import registry as REG
from .tracking import runs as T
from .tracking.release_lock import ReleaseLock


def world_inputs(world: str | None, **explicit) -> dict:
    """The certification inputs of a fixture directory, overridden by explicit paths."""
    defaults = {}
    if world:
        j = lambda *p: os.path.join(world, *p)  # noqa: E731
        defaults = {"reference": j("policy"), "gold": j("data", "gold_calib.jsonl"), "rm_dir": j("reward_model"),
                    "pilot_prompts": j("data", "prompts_dev.jsonl")}
    out = {**defaults, **{k: v for k, v in explicit.items() if v}}
    for k in ("reference", "gold"):
        if not out.get(k):
            raise InputError(f"certify needs --{k} (or --world, a fixture directory that has it)")
    return out


def certification_metrics(report: dict) -> dict:
    m = {}
    groups = {**report["families"], **{k: report[k] for k in ("balanced", "pilot") if k in report}}
    for f, r in groups.items():
        m[f"certifiable/{f}"] = float(r["certifiable"])
        m[f"reference_quality/{f}"] = r["reference"]
        for key, name in (("estimate", "certified"), ("lo", "certified_lo"), ("hi", "certified_hi"),
                          ("gain", "gain"), ("gain_lo", "gain_lo"), ("gain_hi", "gain_hi"),
                          ("ess", "ess"), ("pop_ess", "pop_ess"), ("khat", "khat"), ("kl", "kl"),
                          ("snips", "snips"), ("direct", "direct")):
            v = r.get(key)
            if v is not None and abs(v) != float("inf"):
                m[f"{name}/{f}"] = v
    return m


def run_certify(version: str | None = None, policy: str | None = None, world: str | None = None,
                reference: str | None = None, gold: str | None = None, rm_dir: str | None = None,
                correction: str | None = None, diagnostic: str | dict | None = None, pilot_prompts: str | None = None,
                cfg: C.CertifyConfig = C.CertifyConfig(), echo: Callable[[str], None] = print,
                tags: dict | None = None, out: str | None = None) -> dict:
    """Certify a registered version (or a plain checkpoint directory) as an MLflow run; `out` receives
    the report JSON, written before the version is tagged (a failure leaves the version untagged)."""
    if bool(version) == bool(policy):
        raise InputError("certify needs exactly one of --model-version or --policy")
    if out:
        check_writable(out)
    inputs = world_inputs(world, reference=reference, gold=gold, rm_dir=rm_dir, pilot_prompts=pilot_prompts)
    wrapper = load_wrapper(correction)  # the bytes hashed below are the bytes certify executes
    params = {**inputs, "model_version": version, "policy": policy, "correction": correction,
              "diagnostic": diagnostic if isinstance(diagnostic, str) or diagnostic is None else "(in memory)",
              **{f"certify.{k}": v for k, v in cfg.__dict__.items()}}
    if wrapper:
        params["correction_sha256"] = wrapper.sha256
    with T.tracked_run("certify", params, tags=tags,
                       run_name=f"certify-v{version}" if version else "certify") as run:
        model_id = None
        if version:
            REG.get_version(version)
            policy, model_id = REG.download_policy(version)
        if wrapper:
            T.log_bytes(wrapper.source, os.path.basename(wrapper.path), "correction")
        report = C.certify(policy, inputs["reference"], inputs["gold"], rm_dir=inputs.get("rm_dir"),
                           correction=wrapper, diagnostic=diagnostic,
                           pilot_prompts=inputs.get("pilot_prompts"), cfg=cfg)
        report["subject"] = ({"registered_model": REG.REGISTERED_MODEL, "model_version": str(version),
                              "model_id": model_id} if version else {"policy": policy})
        T.log_metrics(certification_metrics(report), model_id=model_id)
        sha = T.log_json_artifact(report, REG.CERT_ARTIFACT)
        T.log_text(certification_markdown(report), "certification.md")
        T.log_figure(certification_plot(report), "figures/certification.png")
        if out:
            atomic_write_json(out, report)
        if version:  # last: a failure above leaves the version untagged
            REG.set_tags(version, {"certification.run_id": run.info.run_id, "certification.sha256": sha,
                                   "certification.balanced": REG.balanced_tag(report),
                                   **({"correction_sha256": wrapper.sha256} if wrapper else {})})
        echo(_summary_line(report, version))
    return {"run_id": run.info.run_id, "report": report}


def _summary_line(report: dict, version) -> str:
    b = report["balanced"]
    who = f"version {version}" if version else "policy"
    if not b["certifiable"]:
        return f"certify {who}: balanced quality NOT certifiable ({b['reason']})"
    return (f"certify {who}: balanced {b['estimate']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}], "
            f"gain {b['gain']:+.3f} [{b['gain_lo']:+.3f}, {b['gain_hi']:+.3f}] vs reference {b['reference']:.3f}")


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
            T.log_metrics({f"guardrail/{k}": float(ok) for k, (ok, _) in results.items()} | {"promoted": float(passed)})
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
        failed = [k for k, (ok, _) in results.items() if not ok]
        echo(f"release version {mv.version}: {decision}" + (f" (failed: {', '.join(failed)})" if failed else
                                                            " -> models:/rlhf-policy@champion"))
    return {"run_id": run.info.run_id, "decision": decision, "guardrails": results, "certification_run": cert_run}


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
                      cfg=C.CertifyConfig(**report.get("config", {})), shortcuts=report.get("shortcut_rules") or [])
    groups = [(f, report["families"].get(f, {}), row) for f, row in fresh["families"].items()]
    groups.append(("balanced", report["balanced"], fresh["balanced"]))
    for group, claimed, got in groups:
        for key in COMPARED + tuple(f"shortcut{i}.{k}" for i in range(len(got.get("shortcuts", [])))
                                    for k in ("policy_count", "reference_count")):
            a, b = _field(claimed, key), _field(got, key)
            same = a == b if isinstance(b, bool) or b is None or a is None else abs(float(a) - float(b)) <= TOLERANCE
            if not same:
                raise InputError(f"certification run {run_id} refused for version {version.version}: recomputed from "
                                 f"its inputs, {group} {key} is {b}, the report says {a}")
    return "recomputed"


def _field(row: dict, key: str):
    if not key.startswith("shortcut"):
        return row.get(key)
    i, k = key[len("shortcut"):].split(".")
    items = row.get("shortcuts") or []
    return items[int(i)].get(k) if int(i) < len(items) else None


def run_grade(version: str, world: str, n: int = 4, echo: Callable[[str], None] = print) -> dict:
    """The oracle's true quality of a registered version, on its own run linked to the version's model."""
    REG.get_version(version)
    policy_dir, model_id = REG.download_policy(version)
    out = run_grade_checkpoint(policy_dir, world, n, model_id=model_id, run_name=f"grade-v{version}",
                               params={"model_version": version})
    REG.set_tags(version, {"grade.run_id": out["run_id"]})
    echo(f"grade version {version}: truth/balanced {out['truth']['truth/balanced']:.3f}")
    return out


def run_grade_checkpoint(policy_dir: str, world: str, n: int = 4, model_id: str | None = None,
                         run_name: str = "grade", params: dict | None = None) -> dict:
    """`truth/<family>` and `truth/balanced` of a checkpoint on the world's balanced prompts."""
    from . import data as D
    from . import model as M
    from .evaluate import balanced_prompts
    from .world.oracle import Oracle
    params = {**(params or {}), "policy": policy_dir, "world": os.path.abspath(world), "n": n}
    with T.tracked_run("grade", params, run_name=run_name) as run:
        oracle = Oracle(world)
        prompts = balanced_prompts(D.read_jsonl(os.path.join(world, "data", "prompts_train.jsonl")))
        truth = oracle.grade_policy(M.load_policy(policy_dir)[0], prompts, n=n)
        T.log_metrics(truth, model_id=model_id)
    return {"run_id": run.info.run_id, "truth": truth}
