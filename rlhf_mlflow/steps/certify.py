"""The `certify` step: a policy's true quality per family, estimated off-policy from the expert set
(decisions/certify.py), as an MLflow run: `certify/certified/balanced` with its interval and gain, the
families certified and the labels spent as metrics, per family in two tables (what is charted, every
number) and a figure, a markdown report, linked to the
version's LoggedModel. The version is tagged with the run and its report's sha256, last, so a failure
leaves it untagged (the labels it used and the correction's sha256 are the run's metric and params)."""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import replace

import pandas as pd

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.files import atomic_write_json
from rlhf_mlflow.core.reward_wrapper import load_wrapper
from rlhf_mlflow.core.world_paths import WORLD_INPUTS, WorldPaths, input_problem
from rlhf_mlflow.decisions import certify as C
from rlhf_mlflow.decisions import sequential as S
from rlhf_mlflow.decisions.label_requests import check_labels, labels_used
from rlhf_mlflow.evidence import certify as EC
from rlhf_mlflow.steps.figures import certification_plot
from rlhf_mlflow.steps.outputs import check_out
from rlhf_mlflow.steps import selection as SEL
from rlhf_mlflow.steps.reports import certification_markdown, rounded
from rlhf_mlflow.tracking import label_looks as LL
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import rm_registry as RMR
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking import world_record as WR


def world_inputs(world: WorldPaths | None, **explicit) -> dict:
    """The certification inputs a world provides, overridden by explicit paths."""
    defaults = {}
    if world:
        defaults = {"reference": world.policy, "gold": world.expert_set, "rm_dir": world.reward_model,
                    "pilot_prompts": world.prompts_dev}
    out = {**defaults, **{k: os.path.abspath(v) for k, v in explicit.items() if v}}
    for k in ("reference", "gold"):
        if not out.get(k):
            raise InputError(f"certify needs --{k} (or --world, a fixture directory that has it)")
    return out


def world_input_problem(key: str, path: str, record: WR.WorldRecord) -> str | None:
    """Why `path` (certify's input `key`) is not the world `record` recorded, or None: the world's own file
    (directory) as recorded, or, for the reward model, a version of `rlhf-reward-model` repaired on that
    world, byte for byte (every file of its directory)."""
    problem = input_problem(key, path, record.files)
    if problem and key == "rm_dir" and os.path.isdir(path) and RMR.find(record.digest, content_sha256(path)) is not None:
        return None
    return problem


def check_world_inputs(inputs: dict, record: WR.WorldRecord | None, version) -> None:
    """A version trained on a world is certified on that world's files as its training run recorded them,
    or on a reward model repaired on that world, whichever options named them; InputError naming the
    first that is not. A version trained on no world (record None) is certified on whatever it is given."""
    for k in WORLD_INPUTS:
        problem = record and inputs.get(k) and world_input_problem(k, inputs[k], record)
        if problem:
            raise InputError(f"--{k.replace('_', '-')}: version {version} was trained on world "
                             f"{record.digest[:12]} (recorded by its training run {record.run_id}), and {problem}")


RULES_PARAM = "shortcut_rules_sha256"


def rules_sha256(rules: list[dict] | None) -> str:
    """sha256 of a certification's flagged shortcut rules (null: no diagnostic was given), as its run logs
    them: the rules decide marker_collapse, and a report is an artifact that can be replaced."""
    return hashlib.sha256(json.dumps(rules, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


CHARTED = (("estimate", "certified"), ("lo", "certified_lo"), ("hi", "certified_hi"), ("gain", "gain"),
           ("gain_lo", "gain_lo"))
"""The balanced numbers a reader compares across versions, logged as `certify/<name>/balanced`, beside
`certify/families_certified` and `certify/policy_labels/total` (at most 7 metrics); per family they are
in the table `certify_families.json` and the figure, every other number in `certification_table.json`."""
FAMILY_TABLE = "certify_families.json"
TABLE_COLUMNS = ("certifiable", "estimate", "lo", "hi", "gain", "gain_lo", "gain_hi", "reference", "ess",
                 "pop_ess", "khat", "kl", "snips", "direct", "labels", "evidence", "labels_weight", "reason")


def _groups(report: dict) -> dict:
    return {**report["families"], **{k: report[k] for k in ("balanced", "pilot") if k in report}}


def certification_metrics(report: dict, labels: int = 0) -> dict:
    """The CHARTED balanced numbers that are finite, the number of families certified, the labels spent."""
    b = report["balanced"]
    m = {f"{MN.CERTIFY}{name}/balanced": b[key] for key, name in CHARTED
         if b.get(key) is not None and math.isfinite(b[key])}
    return m | {f"{MN.CERTIFY}families_certified": sum(bool(r["certifiable"]) for r in report["families"].values()),
                f"{MN.CERTIFY}policy_labels/total": labels}


def family_table(report: dict, counts: dict[str, int]) -> pd.DataFrame:
    """Per family (then balanced, pilot): the CHARTED numbers, ESS and the policy labels spent on it."""
    rows = [{"family": f, **{name: r.get(key) for key, name in CHARTED}, "ess": r.get("ess"),
             "policy_labels": counts.get(f, sum(counts.values()) if f == "balanced" else None)}
            for f, r in _groups(report).items()]
    return pd.DataFrame(rows, columns=["family", *(name for _, name in CHARTED), "ess", "policy_labels"])


def certification_table(report: dict) -> pd.DataFrame:
    """One row per family (then balanced, pilot): every number certify computed (to 4 decimals: the
    report holds them in full), which evidence certified it (labels_weight: the policy labels' weight in a
    joint estimate, 1 for labels alone), and why it refused."""
    rows = [{"family": f, **{c: rounded(r.get(c)) for c in TABLE_COLUMNS},
             "labels_weight": rounded((r.get("evidence_weights") or {}).get("policy_labels"))}
            for f, r in _groups(report).items()]
    return pd.DataFrame(rows, columns=["family", *TABLE_COLUMNS])


def run_certify(version: str | None = None, policy: str | None = None, world: WorldPaths | None = None,
                reference: str | None = None, gold: str | None = None, rm_dir: str | None = None,
                correction: str | None = None, diagnostic: str | dict | None = None, pilot_prompts: str | None = None,
                cfg: C.CertifyConfig = C.CertifyConfig(), echo: Callable[[str], None] = print,
                tags: dict | None = None, out: str | None = None, policy_labels: str | None = None,
                run_name: str | None = None, policy_impl: str | None = None, reward_impl: str | None = None) -> dict:
    """Certify a registered version (or a plain checkpoint directory) as an MLflow run; `out` receives
    the report JSON, written before the version is tagged (a failure leaves the version untagged).
    `policy_labels`: expert labels on the version's own responses, checked against the label requests
    logged for it (label_requests step), certify the families that have enough of them. `policy_impl` /
    `reward_impl`: import paths of another implementation of the model protocol (core/protocol.py), called
    with the policy's and the reward model's locations."""
    if bool(version) == bool(policy):
        raise InputError("certify needs exactly one of --model-version or --policy")
    inputs = world_inputs(world, reference=reference, gold=gold, rm_dir=rm_dir, pilot_prompts=pilot_prompts,
                          correction=correction, policy_labels=policy_labels)
    if out:
        check_out(out, {**{f"--{k.replace('_', '-')}": v for k, v in inputs.items()}, "--policy": policy,
                        "--diagnostic": diagnostic if isinstance(diagnostic, str) else None,
                        "--world": world.root if world else None})
    wrapper = load_wrapper(inputs.get("correction"))  # the bytes hashed below are the bytes certify executes
    hashes = {k: content_sha256(v) for k, v in inputs.items() if k != "correction" and os.path.exists(v)}
    cfg = at_look(EC.config_for(cfg, inputs.get("rm_dir")), version, hashes.get("policy_labels"))  # as used, logged
    cfg, chosen = SEL.for_expert_set(cfg, version, inputs["gold"])
    params = {**inputs, "model_version": version, "policy": policy, "policy_impl": policy_impl, "reward_impl": reward_impl,
              "diagnostic": diagnostic if isinstance(diagnostic, str) or diagnostic is None else "(in memory)",
              **{f"{k}_sha256": sha for k, sha in hashes.items()},
              **{f"certify.{k}": v for k, v in cfg.__dict__.items()}}
    if wrapper:
        params["correction_sha256"] = wrapper.sha256
    # before the run: a version of another world, another world's files, or a world whose files are not
    # the store's record of it, refused with nothing logged
    if version:
        check_world_inputs(inputs, WR.version_record(REG.version_for_world(version, world)), version)
    if world:
        params.update(WR.world_params(world))
    with T.tracked_run("certify", params, tags=tags,
                       run_name=run_name or (f"certify-v{version}" if version else "certify")
                       + ("-labels" if policy_labels else "")) as run:
        model_id = None
        if version:
            policy, model_id = REG.download_policy(version)
        if wrapper:
            T.log_bytes(wrapper.source, os.path.basename(wrapper.path), "correction")
        labels, used = _checked_labels(inputs.get("policy_labels"), version, hashes.get("policy_labels"))
        report = EC.certify(policy, inputs["reference"], inputs["gold"], rm_dir=inputs.get("rm_dir"),
                            correction=wrapper, diagnostic=diagnostic, pilot_prompts=inputs.get("pilot_prompts"),
                            cfg=cfg, policy_labels=inputs.get("policy_labels"), policy_impl=policy_impl,
                            reward_impl=reward_impl)
        T.log_params({RULES_PARAM: rules_sha256(report.get("shortcut_rules"))})  # what release checks them by
        report["subject"] = ({"registered_model": REG.REGISTERED_MODEL, "model_version": str(version),
                              "model_id": model_id} if version else {"policy": policy})
        report.update({k: v for k, v in (("labels_used", used), ("chosen_on", chosen)) if v})
        _log_report(report, model_id, labels, out)
        sha = T.log_json_artifact(report, REG.CERT_ARTIFACT)
        if version:  # last: a failure above leaves the version untagged
            REG.set_tags(version, {"certification.run_id": run.info.run_id, "certification.sha256": sha})
        T.set_tags({"rlhf.summary": _short_summary(report)})  # what `rlhf-mlflow runs` shows beside the run
        echo(_summary_line(report, version))
    return {"run_id": run.info.run_id, "report": report}


def at_look(cfg: C.CertifyConfig, version: str | None, labels_sha: str | None) -> C.CertifyConfig:
    """`cfg` at the look the version's labels file (its sha256) is, counted from the store
    (tracking/label_looks.py): with a spending rule, its `label_look`; with a union bound, refused beyond
    `label_looks`. A plain checkpoint's looks are the caller's to count."""
    if not (version and labels_sha) or cfg.label_sequential:
        return cfg
    look = LL.look_of(labels_sha, LL.looks(version))
    before = f"version {version}'s labels were looked at by {look - 1} certify runs with other labels files before"
    shares = S.spending_shares(cfg.label_spending)
    if shares:
        if look > len(shares):
            raise InputError(f"{before}: label_spending {cfg.label_spending!r} pays for {len(shares)} looks, "
                             f"this would be look {look}")
        return replace(cfg, label_look=look)
    if look > cfg.label_looks:
        raise InputError(f"{before}: an interval union-bounded over --label-looks {cfg.label_looks} is not valid "
                         f"at look {look}; certify with --label-looks >= {look} (the looks planned), or a spending rule")
    return cfg


def _checked_labels(path: str | None, version: str | None, sha256: str | None) -> tuple[list[dict], dict | None]:
    """Policy labels as given, checked (and, for a version, against the requests logged for it), and the
    report's `labels_used`: the file with its sha256 (as the run logged it) and what they were bought on,
    the version and the label_requests run whose requests they answer (a plain checkpoint's labels were
    checked against nothing: they name the checkpoint)."""
    if not path:
        return [], None
    labels = D.read_jsonl(path, labelled=True, scale=D.EXPERT)
    mv = REG.get_version(version) if version else None
    requests = REG.label_requests_for(mv) if mv is not None else None
    check_labels(labels, requests, path)
    T.log_records_input(labels, path, "policy_labels")
    bought_on = ({"registered_model": REG.REGISTERED_MODEL, "model_version": str(version),
                  "label_requests_run": mv.tags.get("label_requests.run_id")} if mv is not None
                 else {"policy": "the --policy checkpoint (labels not checked against logged requests)"})
    return labels, labels_used(path, sha256, labels, bought_on)


def _log_report(report: dict, model_id: str | None, labels: list[dict], out: str | None) -> None:
    counts = {f: sum(r["family"] == f for r in labels) for f in report["families"]}
    T.log_metrics(certification_metrics(report, len(labels)), model_id=model_id)
    T.log_table(family_table(report, counts), FAMILY_TABLE)
    T.log_table(certification_table(report), "certification_table.json")
    T.log_text(certification_markdown(report), "certification.md")
    T.log_figure(certification_plot(report), "figures/certification.png")
    if out:
        atomic_write_json(out, report)


def _short_summary(report: dict) -> str:
    b = report["balanced"]
    if b["certifiable"]:
        return f"certified {b['estimate']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}]"
    return "not certifiable: " + (", ".join(f for f, r in report["families"].items() if not r["certifiable"])
                                  or b.get("reason", ""))


def _summary_line(report: dict, version) -> str:
    b = report["balanced"]
    who = f"version {version}" if version else "policy"
    if not b["certifiable"]:
        return f"certify {who}: balanced quality NOT certifiable ({b['reason']})"
    if b["gain"] is None:
        return (f"certify {who}: balanced {b['estimate']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}], gain unknown (no "
                "expert set: the reference's quality)")
    return (f"certify {who}: balanced {b['estimate']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}], "
            f"gain {b['gain']:+.3f} [{b['gain_lo']:+.3f}, {b['gain_hi']:+.3f}] vs reference {b['reference']:.3f}")

