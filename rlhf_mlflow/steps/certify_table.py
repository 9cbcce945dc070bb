"""The `certify` step for a policy trained anywhere: certified from a table of its samples
(decisions/table_certify.py), as the same MLflow run `certify` makes (step `certify`: its report, metrics,
tables, figure and markdown), so that release, the UI, the story and pandas treat it like any other.

The version is an existing one of `rlhf-policy` (`--model-version`, e.g. one a user registered from
any MLflow flavor), or a new one made here (`--register NAME --model-uri URI`: its source is the URI,
its run this certify run, its tags the evidence's lineage: the samples' and labels' sha256). Every input
is hashed into the run's parameters first, so release recomputes the certification from the same files
and refuses a changed one.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions import certify as C
from rlhf_mlflow.decisions.table_certify import table_report
from rlhf_mlflow.steps.certify import RULES_PARAM, _log_report, _short_summary, _summary_line, rules_sha256
from rlhf_mlflow.steps.certify import at_look, check_world_inputs
from rlhf_mlflow.steps import selection as SEL
from rlhf_mlflow.steps.outputs import check_out
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking import world_record as WR
from rlhf_mlflow.tracking.external_versions import register_external, unregister

def run_certify_table(samples: str, labels: str, expert_set: str | None = None, diagnostic: str | None = None,
                      version: str | None = None, register: str | None = None, model_uri: str | None = None,
                      world: WorldPaths | None = None, cfg: C.CertifyConfig = C.CertifyConfig(),
                      out: str | None = None, echo: Callable[[str], None] = print) -> dict:
    """Certify a policy from its samples table as an MLflow `certify` run and tag the version (an existing
    one, or a new one of rlhf-policy registered here from `model_uri` under the name `register`)."""
    if bool(version) == bool(register):
        raise InputError("certify-table needs exactly one of --model-version or --register NAME (with --model-uri)")
    if register and not model_uri:
        raise InputError("--register needs --model-uri: where the policy lives (any MLflow model URI or path)")
    expert_set = expert_set or (world.expert_set if world else None)
    inputs = {k: os.path.abspath(v) if v else None
              for k, v in {"samples": samples, "labels": labels, "expert_set": expert_set,
                           "diagnostic": diagnostic}.items()}
    if out:
        check_out(out, {f"--{k.replace('_', '-')}": v for k, v in inputs.items()})
    cfg = at_look(cfg, version, content_sha256(inputs["labels"]))
    cfg, chosen = SEL.for_expert_set(cfg, version, inputs["expert_set"], table=True)
    report = table_report(inputs, cfg)  # every table read and checked before any run or version exists
    if chosen:
        report["chosen_on"] = chosen
    mv = REG.get_version(version) if version else None
    if mv is not None:
        check_world_inputs(inputs, WR.version_record(mv), version)
    params = {**inputs, **{f"{k}_sha256": v for k, v in report["input_sha256"].items() if k != "gold"},
              "model_version": version, "model_uri": model_uri, "registered_as": register,
              **(WR.world_params(world) if world else {}), **{f"certify.{k}": v for k, v in cfg.__dict__.items()},
              RULES_PARAM: rules_sha256(report.get("shortcut_rules"))}
    with T.tracked_run("certify", params, tags={"rlhf.certify.kind": "table", **({"rlhf.recipe": register}
                                                                                 if register else {})},
                       run_name=f"certify-table-{register or f'v{version}'}") as run:
        if register:
            version = register_external(register, model_uri, run.info.run_id, report["input_sha256"])
            echo(f"certify-table: registered {model_uri} as {REG.REGISTERED_MODEL} version {version} ({register})")
        try:
            _record(report, version, bool(register), run.info.run_id, out, echo)
        except BaseException:
            if register:  # a run that fails leaves the registry as it was: no version without its certification
                unregister(version)
            raise
    return {"run_id": run.info.run_id, "model_version": str(version), "report": report}


def _record(report: dict, version: str, registered: bool, run_id: str, out: str | None,
            echo: Callable[[str], None]) -> None:
    """The report as certify logs one (metrics, tables, figure, markdown, the artifact), then the version's
    certification tags, last."""
    report["subject"] = {"registered_model": REG.REGISTERED_MODEL, "model_version": str(version),
                         "model_id": getattr(REG.get_version(version), "model_id", None)}
    report["labels_used"]["bought_on"].update(report["subject"])  # the samples are this version's answers
    if registered:
        T.log_params({"model_version": str(version)})
    n_labels = sum(r.get("labels", 0) or 0 for r in report["families"].values())
    _log_report(report, report["subject"]["model_id"], [{"family": f} for f, r in report["families"].items()
                                                         for _ in range(r.get("labels", 0) or 0)], out)
    sha = T.log_json_artifact(report, REG.CERT_ARTIFACT)
    REG.set_tags(version, {"certification.run_id": run_id, "certification.sha256": sha})
    T.set_tags({"rlhf.summary": _short_summary(report)})
    echo(_summary_line(report, version) + f" ({n_labels} expert labels on its samples)")
