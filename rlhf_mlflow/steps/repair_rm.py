"""The `repair_rm` step: a reward model repaired with every expert label so far, registered as a version
of `rlhf-reward-model` with its lineage, and promoted to `production` only through the gate.

parent (a version, `production` of this world, or the world's own reward model, registered on first
use as its lineage's root) -> training/repair_rm.py (crowd QA minus the flagged premiums, the expert
set, every bought labels file; cross-validated agreement per family against the parent) -> the
diagnostic on the repaired model -> decisions/rm_gate.py -> a new version (tags parent_version,
world_hash, recipe, sha256; dataset inputs with digests) -> `production` moved, or REFUSED with why.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict

import pandas as pd

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.errors import read_json
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions import rm_gate
from rlhf_mlflow.decisions.correction import fit_corrections
from rlhf_mlflow.decisions.label_requests import check_prompts_known, read_label_files
from rlhf_mlflow.evidence.diagnostic import run_diagnostic
from rlhf_mlflow.steps.outputs import check_out_dir
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import rm_registry as RMR
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking import world_record as WR
from rlhf_mlflow.tracking.metric_logger import MetricLogger
from rlhf_mlflow.training import repair_rm as RR


def _checked_labels(world: WorldPaths, labels: list[str]) -> list[dict]:
    rows = read_label_files(labels)
    prompts = {p: D.read_jsonl(p) for p in (world.expert_set, world.prompts_train, world.prompts_dev)}
    check_prompts_known(rows, prompts, world.root)
    return rows


def _parent(world: WorldPaths, digest: str, parent_version: str | None, tmp: str) -> tuple[str, str | None, str | None]:
    """(local directory, version) of the model to fine-tune, and the production version it would replace
    (`digest`: the world's content digest, as the run records it).
    By default the world's own model: every repair starts from it with every label so far, so its
    agreement is compared with a parent that never saw them. Its version is None until `_register_root`
    registers it, at the end beside the repair's own: a repair that dies leaves the registry as it was."""
    current = RMR.production()
    replaces = str(current.version) if current is not None and RMR.world_of(current) == digest else None
    if parent_version:
        return RMR.download(parent_version, tmp), str(parent_version), replaces
    root = RMR.find(digest, content_sha256(world.reward_model))
    if root is not None:
        return RMR.download(root.version, tmp), str(root.version), replaces
    return world.reward_model, None, replaces


def _register_root(world: WorldPaths, run_id: str, replaces: str | None) -> str:
    """The world's own reward model as the root version of its lineage (production when none is)."""
    h = world.build_hash()
    T.log_artifact(world.reward_model, "world_reward_model")
    text = f"World {h}'s own reward model: the root of its repairs."
    version = RMR.register(run_id, world.reward_model, {"world_hash": h, "parent_version": "none",
                                                        "recipe": "the world's own"}, text, artifact="world_reward_model")
    if replaces is None:
        RMR.decide(version, {}, text, run_id)
    return version


def run_repair_rm(world: WorldPaths, labels: list[str], out: str, diagnostic: str | None = None,
                  parent_version: str | None = None, cfg: RR.RepairConfig = RR.RepairConfig(),
                  echo: Callable[[str], None] = print, run_name: str = "repair_rm", overwrite: bool = False) -> dict:
    """Repair, register and gate; returns {"version", "parent_version", "replaces", "promoted", "gate",
    "agreement", "diagnostic" (the repaired model's), "out", "run_id"}. `out` follows the one output
    rule (outputs.py): new or empty, or with `overwrite` another repair_rm run's; written whole, marked."""
    check_out_dir(out, RR.STEP, reads(world, diagnostic, labels), overwrite=overwrite)
    experts_bought = _checked_labels(world, labels)  # before the run: bad input leaves no run behind
    recorded = WR.world_params(world)  # what the run records of its world (refused when not the store's record)
    if parent_version:
        RMR.get(parent_version, recorded[WR.DIGEST])
    parent_diag = read_json(diagnostic) if diagnostic else None
    qa = D.read_jsonl(world.qa, labelled=True, scale=D.CROWD)
    gold = D.read_jsonl(world.expert_set, labelled=True, scale=D.EXPERT)
    params = {**asdict(cfg), **recorded, "labels": ",".join(labels), "diagnostic": diagnostic,
              "parent_version": parent_version, "out": out}
    with T.tracked_run("repair_rm", params, run_name=run_name) as run, tempfile.TemporaryDirectory() as tmp:
        parent_dir, parent, replaces = _parent(world, recorded[WR.DIGEST], parent_version, tmp)
        for path, rows, ctx in [(world.qa, qa, "crowd"), (world.expert_set, gold, "expert")] + \
                [(p, [r for r in experts_bought if r["id"] in _ids(p)], "expert") for p in labels]:
            T.log_records_input(rows, path, ctx)
        rules = fit_corrections(parent_diag, qa, diagnostic) if parent_diag else []
        echo(f"repair_rm: parent {f'v{parent}' if parent else 'the world model'}, {len(gold) + len(experts_bought)} expert labels, "
             f"{len(rules)} premiums taken out of the crowd's labels; cross-validating ({cfg.folds} folds)")
        logger = MetricLogger()
        anchors = RR.anchor_rows(parent_dir, world.policy, D.read_jsonl(world.prompts_train), cfg.anchors, rules, cfg.seed)
        rm, info = RR.repair(parent_dir, qa, gold + experts_bought, rules, cfg,
                             on_log=lambda e, m: logger(e, MN.prefixed(MN.REPAIR, m)),
                             on_fold=lambda k: echo(f"  fold {k + 1}/{cfg.folds}"), anchors=anchors)
        logger.flush()
        members = _ensemble(parent_dir, qa, gold + experts_bought, rules, cfg, anchors, info, echo)
        RR.save_repaired(rm, R.load_rm(parent_dir)[1], qa, info, out, members, run.info.run_id)
        # the repair's expert labels credit what they show to be correctness (a label head pays for
        # tokens under attribute values: the truth's own form, not a shortcut)
        experts_file = os.path.join(tmp, "experts.jsonl")
        D.write_jsonl(experts_file, gold + experts_bought)
        child_diag = run_diagnostic(out, world.policy, world.prompts_train, gold_path=experts_file)
        child_paid = fit_corrections(child_diag, qa, "the repaired model's diagnostic")
        gate = rm_gate.evaluate(info["agreement"], SR.flagged(parent_diag) if parent_diag else [], child_paid)
        _log_measurements(info, child_diag, gate)
        T.log_artifact(out, RMR.ARTIFACT)
        parent = parent or _register_root(world, run.info.run_id, replaces)
        T.set_tags({"rlhf.rm.parent_version": parent, "rlhf.rm.replaces": replaces or "none"})
        version = RMR.register(run.info.run_id, out, {"world_hash": world.build_hash(), "parent_version": parent,
                                                     "replaces": replaces or "none",
                                                     "recipe": f"repair e{cfg.epochs} lr{cfg.lr:g} crowd{cfg.crowd_weight:g}"
                                                               + (f" head-{cfg.head_fit}{cfg.head_alpha:g}" if cfg.label_head else ""),
                                                     "expert_labels": len(gold) + len(experts_bought)})
        promoted = RMR.decide(version, _failed(gate), _description(version, parent, info, gate), run.info.run_id)
        T.log_metrics({MN.REPAIR + "promoted": float(promoted)})
        echo(f"repair_rm: version {version} " + ("promoted to production" if promoted else
                                                 f"REFUSED ({rm_gate.summary(gate)})"))
    return {"version": version, "parent_version": parent, "replaces": replaces, "promoted": promoted, "gate": gate, "out": out,
            "agreement": info["agreement"], "diagnostic": child_diag, "run_id": run.info.run_id}


def reads(world: WorldPaths | None, diagnostic: str | None, labels: list[str]) -> dict[str, str | None]:
    """What a repair reads, by option: what its --out may not be or hold."""
    return {"--world": world.root if world else None, "--diagnostic": diagnostic,
            **{f"--labels[{i}]": p for i, p in enumerate(labels)}}


def _ensemble(parent_dir: str, qa: list[dict], experts: list[dict], rules: list[dict], cfg: RR.RepairConfig,
              anchors: list[dict], info: dict, echo: Callable[[str], None]) -> list:
    """cfg.ensemble members on the repair's data (none when 0); their recipe goes into `info`."""
    if not cfg.ensemble:
        return []
    from rlhf_mlflow.training.rm_ensemble import ensemble_for_repair
    echo(f"  ensemble: {cfg.ensemble} members (bootstrap, new heads)")
    info["ensemble"] = {"members": cfg.ensemble, "method": "bootstrap fine-tunes with new heads"}
    return ensemble_for_repair(parent_dir, qa, experts, rules, cfg, anchors)


def _ids(path: str) -> set[str]:
    return {r["id"] for r in D.read_jsonl(path, labelled=True, scale=D.EXPERT)}


def _failed(gate: dict) -> dict[str, str]:
    return {g: ", ".join(fams)[:30] for g, fams in gate.items() if fams}


def _description(version: str, parent: str, info: dict, gate: dict) -> str:
    head = (f"REFUSED v{version}: {', '.join(g for g, f in gate.items() if f)}" if rm_gate.refused(gate)
            else f"production v{version}: agrees with the experts at least as well as v{parent}")
    rows = "\n".join(f"| {f} | {d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] | {info['agreement']['child'][f]['r']:.3f} |"
                     for f, d in info["agreement"]["difference"].items())
    return (f"{head}\n\n{rm_gate.summary(gate)}\n\n| family | r minus parent's (95%) | r (cross-validated) |\n"
            f"|---|---|---|\n{rows}\n")


def _log_measurements(info: dict, child_diag: dict, gate: dict) -> None:
    """Few charts: the balanced agreement of child and parent; per family a table."""
    child, parent = info["agreement"]["child"], info["agreement"]["parent"]
    mean = lambda d: sum(v["r"] for v in d.values()) / max(1, len(d))  # noqa: E731
    T.log_metrics({MN.REPAIR + "agreement_balanced": mean(child), MN.REPAIR + "parent_agreement_balanced": mean(parent),
                   MN.REPAIR + "expert_labels": float(info["rows"]["expert"])})
    rows = [{"family": f, "r": child[f]["r"], "r_lo": child[f]["lo"], "r_hi": child[f]["hi"],
             "parent_r": parent.get(f, {}).get("r"), **{f"diff_{k}": v for k, v in d.items() if k != "n"},
             "n": d["n"], "flagged_again": f in gate["shortcut"],
             "risk": child_diag["families"].get(f, {}).get("risk"),
             **{k: v for k, v in info.get("label_head", {}).get(f, {}).items() if k != "labels"}}
            for f, d in info["agreement"]["difference"].items()]
    T.log_table(pd.DataFrame(rows), "agreement_families.json")
    T.log_json_artifact(child_diag, "diagnostic_repaired.json")
    T.log_json_artifact(info, "repair.json")
