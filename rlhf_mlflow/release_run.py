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
from collections.abc import Callable

from . import certify as C
from . import guardrails as G
from .errors import InputError
from .files import atomic_write_json, check_writable
from .figures import certification_plot
from .reports import certification_markdown, release_markdown
from .reward_wrapper import load_wrapper
from .tracking import registry as REG
from .tracking import runs as T


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
                correction: str | None = None, diagnostic: str | None = None, pilot_prompts: str | None = None,
                cfg: C.CertifyConfig = C.CertifyConfig(), echo: Callable[[str], None] = print,
                out: str | None = None) -> dict:
    """Certify a registered version (or a plain checkpoint directory) as an MLflow run; `out` receives
    the report JSON, written before the version is tagged (a failure leaves the version untagged)."""
    if bool(version) == bool(policy):
        raise InputError("certify needs exactly one of --model-version or --policy")
    if out:
        check_writable(out)
    inputs = world_inputs(world, reference=reference, gold=gold, rm_dir=rm_dir, pilot_prompts=pilot_prompts)
    wrapper = load_wrapper(correction)  # the bytes hashed below are the bytes certify executes
    params = {**inputs, "model_version": version, "policy": policy, "correction": correction,
              "diagnostic": diagnostic, **{f"certify.{k}": v for k, v in cfg.__dict__.items()}}
    if wrapper:
        params["correction_sha256"] = wrapper.sha256
    with T.tracked_run("certify", params, run_name=f"certify-v{version}" if version else "certify") as run:
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
        T.log_json_artifact(report, REG.CERT_ARTIFACT)
        T.log_text(certification_markdown(report), "certification.md")
        T.log_figure(certification_plot(report), "figures/certification.png")
        if out:
            atomic_write_json(out, report)
        if version:
            b = report["balanced"]
            REG.set_tags(version, {"certification.run_id": run.info.run_id,
                                   "certification.balanced": f"{b['estimate']:.4f}" if b["certifiable"] else "refused",
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
                echo: Callable[[str], None] = print) -> dict:
    """Evaluate the guardrails for `version`; promote it to champion only if every one passes."""
    cfg = G.GuardrailConfig.from_dict(guardrails or {})
    params = {"model_version": version, "certification_run": certification_run,
              **{f"guardrail.{k}": v for k, v in cfg.to_dict().items()}}
    with T.tracked_run("release", params, run_name=f"release-v{version}") as run:
        mv = REG.get_version(version)
        cert_run, report = REG.certification_for(mv, certification_run)
        current = REG.champion_version()
        champion_report = None
        if current is not None and current.version != mv.version:
            champion_report = REG.certification_for(current)[1]
        results = G.evaluate(report, cfg, champion_report)
        if current is not None and current.version == mv.version:
            results["beats_champion"] = (True, "already the champion")
        passed = all(ok for ok, _ in results.values())
        decision = "promoted" if passed else "refused"
        T.log_metrics({f"guardrail/{k}": float(ok) for k, (ok, _) in results.items()} | {"promoted": float(passed)})
        T.log_text(release_markdown(mv.version, results, decision, current.version if current else None),
                   "release.md")
        T.log_json_artifact({"model_version": mv.version, "certification_run": cert_run, "decision": decision,
                             "champion_before": current.version if current else None,
                             "guardrails": {k: {"pass": ok, "reason": why} for k, (ok, why) in results.items()},
                             "config": cfg.to_dict()}, "release.json")
        # every result is on the version before the alias can move
        REG.set_tags(mv.version, {**{f"guardrail.{k}": f"{'pass' if ok else 'fail'}: {why}"
                                     for k, (ok, why) in results.items()},
                                  "release.decision": decision, "release.run_id": run.info.run_id})
        if passed:
            REG.move_champion(mv.version)
        failed = [k for k, (ok, _) in results.items() if not ok]
        echo(f"release version {mv.version}: {decision}" + (f" (failed: {', '.join(failed)})" if failed else
                                                            " -> models:/rlhf-policy@champion"))
    return {"run_id": run.info.run_id, "decision": decision, "guardrails": results, "certification_run": cert_run}


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
