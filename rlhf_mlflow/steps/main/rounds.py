"""`main`'s later rounds: every expert label bought so far goes back into the reward model.

Round 1 is main's story (the world's reward model, corrected). Each later round r:
  1. buys REPAIR_PER_FAMILY expert labels per family on the champion's own responses (only requests not
     labelled already; they count against main's label budget like certification's);
  2. repairs the reward model with every label so far (repair_rm: the world's own model fine-tuned on the
     crowd without its shortcuts, the expert set and every labels file of this main); a refused repair
     ends the rounds;
  3. corrects the repaired model by its own audit (repair_rm's diagnostic -> correction) and trains the
     corrected recipes on it;
  4. dev_eval, certify (buying labels as round 1 does; the repaired model is certify's predictor on the
     candidates' own labels, and the expert set it learnt from certifies nothing), release and grade
     each, as round 1 does.
It stops when the budget cannot pay for a round's repair labels, when the gate refuses the repaired
model, or when a round does not raise the certified champion. Each round is a nested run of main's.
A resumed main (resume.py) skips the rounds rounds.json holds, and in the round it stopped in
reuses the repair labels, the repair, the correction and the candidates it had finished.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.errors import read_json
from rlhf_mlflow.core.files import atomic_write_json
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.correct import run_correction
from rlhf_mlflow.steps.expert_label import run_expert_label
from rlhf_mlflow.steps.label_requests import run_label_requests
from rlhf_mlflow.steps.main import resume as MR
from rlhf_mlflow.steps.main.candidates import CHECKPOINTS, WATCH_EVERY, TrainJob
from rlhf_mlflow.steps.main.labels import LabelBudget, note_purchase
from rlhf_mlflow.steps.repair_rm import run_repair_rm
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.training.recipes import CORRECTED, scaled

REPAIR_PER_FAMILY = 50
"""Expert labels per family on the champion's responses before each repair, its certification's among
them (300 a round, 180 new after a certification's 20 per family). With the label head's guided adaptive
fit, 50 per family took the default world's repaired candidate to truth 0.72-0.74, where the lasso
needed 100 per family for 0.70-0.71 (docs/REPAIR.md "The guided adaptive head")."""
ROUND_PREFIX = "r{r}-"
"""A later round's candidates are named r<round>-<recipe> (the recipe is the part after the prefix)."""


def recipe_of(name: str) -> str:
    """The recipe of a candidate name (`r2-corrected-s800` -> `corrected-s800`)."""
    head, _, rest = name.partition("-")
    return rest if head[:1] == "r" and head[1:].isdigit() and rest else name


def round_of(name: str) -> int:
    """The round a candidate name belongs to (`r2-corrected-s800` -> 2; round 1's have no prefix)."""
    head = name.partition("-")[0]
    return int(head[1:]) if recipe_of(name) != name else 1


@dataclass
class RoundContext:
    world: WorldPaths
    out_dir: str
    parent_run_id: str
    steps_scale: float
    budget: LabelBudget
    evaluate: Callable[..., None]
    """(candidate name, its training summary[, certify's predictor {"rm_dir", "correction"}])"""
    settle: Callable[[], None]
    """The label purchases of the candidates evaluated since (labels.Purchases.settle)."""
    guardrails: dict | None
    echo: Callable[[str], None]
    state: MR.MainState


def labels_so_far(out_dir: str) -> list[dict]:
    """Every expert label this main bought (certification's and repair's), each id once."""
    seen, out = set(), []
    for path in sorted(glob.glob(os.path.join(out_dir, "labels-*.jsonl"))):
        for rec in D.read_jsonl(path, labelled=True, scale=D.EXPERT):
            if rec["id"] not in seen:
                seen.add(rec["id"])
                out.append(rec)
    return out


def _buy_repair_labels(ctx: RoundContext, r: int, version: str) -> int:
    """Labels on the champion's responses, REPAIR_PER_FAMILY per family, skipping those held; returns
    how many were bought (0 when the budget cannot pay for them). Labels bought before a resume are
    these labels (their file is written whole), already counted in the budget."""
    labels = os.path.join(ctx.out_dir, f"labels-r{r}-v{version}.jsonl")
    if os.path.isfile(labels):
        ctx.echo(f"round {r}: {MR.labels_in(labels)} repair labels on version {version} bought before the resume")
        note_purchase(ctx.out_dir, "repair", r, version, labels)
        return MR.labels_in(labels)
    requests = os.path.join(ctx.out_dir, f"label_requests-r{r}-v{version}.jsonl")
    run_label_requests(version, ctx.world, "all", REPAIR_PER_FAMILY, out=requests, echo=lambda m: None,
                       run_name=f"label-requests-r{r}-v{version}")
    held = {rec["id"] for rec in labels_so_far(ctx.out_dir)}
    new = [rec for rec in D.read_jsonl(requests) if rec["id"] not in held]
    if not ctx.budget.afford(len(new)):
        ctx.echo(f"round {r}: label budget left {ctx.budget.total - ctx.budget.spent} < {len(new)}: no repair")
        return 0
    fresh = os.path.join(ctx.out_dir, f"label_requests-r{r}-new.jsonl")
    D.write_jsonl(fresh, new)
    run_expert_label(ctx.world, fresh, labels, echo=lambda m: None, run_name=f"expert-label-r{r}-v{version}")
    ctx.budget.spent += len(new)
    note_purchase(ctx.out_dir, "repair", r, version, labels)
    return len(new)


def _jobs(r: int, rm_dir: str, wrapper: str | None, ctx: RoundContext) -> list[TrainJob]:
    watch = {"watch_every": WATCH_EVERY, "watch_gold": ctx.world.expert_set, "watch_correction": wrapper}
    jobs = []
    for name, ov in CORRECTED.items():
        ov = scaled({**ov, **watch, "reward_model": rm_dir, "reward_wrapper": wrapper}, ctx.steps_scale)
        ov["save_every"] = max(1, ov["steps"] // CHECKPOINTS)
        jobs.append(TrainJob(ROUND_PREFIX.format(r=r) + name, ov,
                             f"Round {r}: trained on the repaired reward model {rm_dir} minus its own fitted corrections.",
                             {"rlhf.corrected": "true", "rlhf.round": str(r)}, select_watch_best=True))
    return jobs


def run_round(ctx: RoundContext, r: int, diagnostic: str, lead: str) -> dict | None:
    """One later round, its repair labels bought on version `lead`; returns its record, or None when
    the budget could not pay for any label."""
    with T.tracked_run("round", {"round": r, "labels_on_version": lead},
                       run_name=f"round-{r}"):
        bought = _buy_repair_labels(ctx, r, lead)
        if not bought and not ctx.budget.afford(1):
            return None
        repaired = _repair(ctx, r, diagnostic)
        record = {"round": r, "rm_version": repaired["version"], "rm_promoted": repaired["promoted"],
                  "rm_agreement": _balanced(repaired["agreement"]["child"]), "repair_labels": bought}
        if not repaired["promoted"]:
            ctx.echo(f"round {r}: the repaired reward model was refused: the rounds stop")
            return record
        # repair_rm audited the repaired model already (its run logs diagnostic_repaired.json)
        record["diagnostic"] = os.path.join(ctx.out_dir, f"diagnostic-r{r}.json")
        atomic_write_json(record["diagnostic"], repaired["diagnostic"])
        wrapper = _correction(ctx, r, repaired)
        predictor = {"rm_dir": repaired["out"], "correction": wrapper}  # certify's, on the candidates' own labels
        done = MR.train_or_reuse(_jobs(r, repaired["out"], wrapper, ctx), ctx.world, ctx.parent_run_id, ctx.state,
                                 ctx.echo, lambda name, s: ctx.evaluate(name, s, predictor))
        ctx.settle()
        record["versions"] = [str(s["model_version"]) for s in done.values()]
        MR.release_and_grade(record["versions"], ctx.world, ctx.guardrails, ctx.state, ctx.echo)
    return record


def _repair(ctx: RoundContext, r: int, diagnostic: str) -> dict:
    """repair_rm with every label so far, or the repair a main this one resumes finished."""
    rm_dir = os.path.join(ctx.out_dir, f"reward_model_r{r}")
    reused = MR.reused_repair(ctx.state, r, rm_dir)
    if reused is not None:
        ctx.echo(f"round {r}: reward model version {reused['version']} ({rm_dir}), repaired before the resume")
        return reused
    merged = os.path.join(ctx.out_dir, f"repair-labels-r{r}.jsonl")
    D.write_jsonl(merged, labels_so_far(ctx.out_dir))
    # main's own directory: a repair an earlier main run of this --out left there (cut short) is replaced
    return run_repair_rm(ctx.world, [merged], rm_dir, diagnostic, echo=ctx.echo, run_name=f"repair_rm-r{r}",
                         overwrite=True)


def _correction(ctx: RoundContext, r: int, repaired: dict) -> str | None:
    """The repaired model's correction (its own audit's flagged shortcuts): the wrapper, or None when
    nothing was flagged; the one a resumed main made before, so that its candidates' inputs stay the same."""
    key = f"correction/r{r}"
    if key not in ctx.state.done:
        wrapper = os.path.abspath(os.path.join(ctx.out_dir, f"correction-r{r}.py"))
        rules = run_correction(repaired["diagnostic"], os.path.join(repaired["out"], "train.jsonl"), wrapper,
                               run_name=f"correction-r{r}")
        ctx.state.mark(key, wrapper if rules else None)
    return ctx.state.done[key]


def _balanced(per_family: dict) -> float:
    vals = [v["r"] for v in per_family.values()]
    return sum(vals) / len(vals) if vals else float("nan")


def later_rounds(ctx: RoundContext, rounds: int, diagnostic: str, corrected: list[str],
                 finished: list[dict] | None = None) -> list[dict]:
    """Rounds 2..rounds; each record: round, rm_version, rm_agreement, champion (before and after),
    labels (total spent). Repair labels are bought on the champion's responses, or with none on the last
    corrected candidate's (`corrected`: round 1's corrected versions, in recipe order). `finished`: the
    records of rounds a main this one resumes finished (rounds.json), not run again."""
    records = []
    for r in range(2, rounds + 1):
        if r - 2 < len(finished or []):
            record = finished[r - 2]
            ctx.echo(f"round {r}: finished before the resume (reward model v{record['rm_version']})")
        else:
            before, spent_before = REG.champion_version(), ctx.budget.spent
            lead = str(before.version) if before is not None else (corrected[-1] if corrected else None)
            record = run_round(ctx, r, diagnostic, lead) if lead is not None else None
            if record is None:
                break
            after = REG.champion_version()
            record.update({"champion_before": before.version if before else None, "labels_before": spent_before,
                           "champion": after.version if after else None, "labels_spent": ctx.budget.spent})
            atomic_write_json(os.path.join(ctx.out_dir, "rounds.json"), records + [record])
        records.append(record)
        if not record["rm_promoted"]:
            break
        corrected = record["versions"]
        if record.get("champion_before") is not None and record["champion_before"] == record["champion"]:
            ctx.echo(f"round {r}: the champion is still version {record['champion']}: the rounds stop")
            break
    return records


def finished_rounds(out_dir: str) -> list[dict]:
    """The records of the rounds after the first that this --out's main finished (rounds.json)."""
    path = os.path.join(out_dir, "rounds.json")
    return read_json(path) if os.path.isfile(path) else []
