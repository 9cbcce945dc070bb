"""The `main` step: the whole story on one world, as a parent MLflow run with a child run per step.

gold-free diagnostic -> correction -> the seed's five historical recipes and two corrected candidates
(kl 0.1/800 and kl 0.05/1200 on the corrected reward, each registered at the checkpoint with the best
balanced truth the over-optimisation watch estimates), trained side by side (candidates.py) -> dev_eval and certify
of each as it finishes -> once all have trained, label purchases, the most promising first (labels.Purchases)
-> release of every candidate, in recipe order -> grade (the oracle's truth,
never read by release) -> the champion's recipe trained on the oracle's true reward (this world's
ceiling for that budget) -> a summary table (summary.py).
A main that stopped continues with `resume` (resume.py: what it reuses, and how it knows it is whole).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import pandas as pd

from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core.config import check_range
from rlhf_mlflow.core.files import atomic_write_json
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions import guardrails as G
from rlhf_mlflow.steps.certify import run_certify
from rlhf_mlflow.steps.correct import run_correction
from rlhf_mlflow.steps.dev_eval import run_dev_eval
from rlhf_mlflow.steps.diagnostic import run_diagnostic_step
from rlhf_mlflow.steps.grade import run_grade_checkpoint
from rlhf_mlflow.steps.main import resume as MR
from rlhf_mlflow.steps.main.candidates import CHECKPOINTS, WATCH_EVERY, TrainJob
from rlhf_mlflow.steps.main.labels import LabelBudget, Purchases, purchase_metrics, purchases, purchases_markdown
from rlhf_mlflow.steps.main.rounds import (
    RoundContext,
    finished_rounds,
    labels_so_far,
    later_rounds,
    recipe_of,
    round_of,
)
from rlhf_mlflow.steps.main.summary import summary_table
from rlhf_mlflow.steps.main.view import publish as publish_front_page
from rlhf_mlflow.steps.reports import markdown_table, rounds_markdown, story_markdown
from rlhf_mlflow.steps.train_rl import run_train_rl
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.training.batch_run import batch_runs
from rlhf_mlflow.training.recipes import CORRECTED, SEED_HISTORY, check_steps_scale, scaled
from rlhf_mlflow.training.rl_config import load_rl_config
from rlhf_mlflow.world.oracle import write_oracle_reward

DEFAULT_LABEL_BUDGET = 1200
"""Expert labels `main` may buy: the first round's certification (on the default world two candidates,
20-50 per refused family), one repair round's REPAIR_PER_FAMILY x 6 and the second round's certification."""
MAX_LABEL_BUDGET = 1_000_000
"""The largest --label-budget (the default world's story spends ~420)."""
MAX_ROUNDS = 20
"""The most --rounds main runs."""
DEFAULT_ROUNDS = 2
"""Rounds `main` runs by default: the story on the world's reward model, then one repair with every
label so far (docs/REPAIR.md: on the default world the repaired model's candidates reach 0.70-0.75 of
truth against 0.52 without a repair)."""
CORRECTED_NOTE = "Trained on the reward model minus the fitted shortcut corrections (diagnostic -> correction)."


def candidate_jobs(wrapper: str | None, steps_scale: float, gold: str | None = None) -> list[TrainJob]:
    """Every candidate's train_rl job, history first; with `gold` (the expert set) each has the watch
    on, its predictor corrected by `wrapper` (the diagnostic's correction); corrected ones are saved at
    each quarter of their steps and registered at the watch's best checkpoint."""
    watch = {"watch_every": WATCH_EVERY, "watch_gold": gold, "watch_correction": wrapper} if gold else {}
    jobs = [TrainJob(n, scaled({**ov, **watch}, steps_scale), note, {"rlhf.history": "seed"})
            for n, (ov, note) in SEED_HISTORY.items()]
    for name, ov in CORRECTED.items():
        ov = scaled({**ov, **watch, "reward_wrapper": wrapper}, steps_scale)
        ov["save_every"] = max(1, ov["steps"] // CHECKPOINTS)
        jobs.append(TrainJob(name, ov, CORRECTED_NOTE, {"rlhf.corrected": "true"}, select_watch_best=bool(gold)))
    return jobs


def run_main(world: WorldPaths, out_dir: str, steps_scale: float = 1.0, ceiling: bool = True,
             echo: Callable[[str], None] = print, label_budget: int = DEFAULT_LABEL_BUDGET,
             guardrails: dict | None = None, rounds: int = DEFAULT_ROUNDS, resume: bool = False,
             overwrite: bool = False) -> pd.DataFrame:
    """The whole story; returns the summary table (its `attrs["ceiling"]` holds the ceiling, if run;
    `attrs["rounds"]` each later round's record).
    `label_budget`: expert labels main may buy on candidates' own responses (labels.py) and for
    repairs; `guardrails`: threshold overrides for every release (GuardrailConfig keys); `rounds`: 1 is
    the story on the world's reward model, each more repairs it with every label so far (rounds.py);
    `resume`: continue the main that stopped in `out_dir`, with its settings (resume.py); `overwrite`:
    start over in the directory a finished main left (the one output rule, steps/outputs.py)."""
    check_steps_scale(steps_scale)  # before the --out directory, main_state.json or any run
    check_range("--label-budget", label_budget, 0, MAX_LABEL_BUDGET, integer=True)
    check_range("--rounds", rounds, 1, MAX_ROUNDS, integer=True)
    MR.check_out(out_dir, {"--world": world.root}, resume, overwrite)
    gates = G.GuardrailConfig.from_dict(guardrails or {})  # what every release (and label purchase) applies
    batch = batch_runs()  # a bad RLHF_BATCH_RUNS fails here, before the run
    state = MR.begin(out_dir, MR.settings(world, steps_scale, label_budget, rounds, guardrails), resume, echo, overwrite)
    t0 = time.perf_counter()
    params = {"world": world.root, "steps_scale": steps_scale, "label_budget": label_budget, "rounds": rounds,
              "batch_runs": batch, **{f"guardrail.{k}": v for k, v in (guardrails or {}).items()}}
    tags = {"rlhf.resumes": state.runs[-1]} if resume and state.runs else None
    with T.tracked_run("main", params, tags=tags, run_name="main") as parent:
        state.runs.append(parent.info.run_id)
        state.save()
        budget = LabelBudget(label_budget, spent=len(labels_so_far(out_dir)))  # labels bought before a resume
        if resume:
            echo(f"resume: main run {state.runs[-2] if len(state.runs) > 1 else '-'} stopped; "
                 f"{budget.spent} expert labels bought before it are reused")
        diag_path, wrapper = _diagnosis(world, out_dir, state, echo)
        evaluate, buyer = _evaluator(world, out_dir, (diag_path, wrapper), budget, gates, state, echo)
        candidates = MR.train_or_reuse(candidate_jobs(wrapper, steps_scale, world.expert_set), world,
                                       parent.info.run_id, state, echo, evaluate)
        buyer.settle()
        # in recipe order: each release compares with the champion so far
        MR.release_and_grade([s["model_version"] for s in candidates.values()], world, guardrails, state, echo)
        ctx = RoundContext(world, out_dir, parent.info.run_id, steps_scale, budget, evaluate, buyer.settle,
                           guardrails, echo, state)
        records = later_rounds(ctx, rounds, diag_path, [s["model_version"] for n, s in candidates.items() if n in CORRECTED],
                               finished_rounds(out_dir) if resume else [])
        table = summary_table(state.runs)
        table.attrs["rounds"] = records
        if ceiling:
            _ceiling_if_new_champion(world, out_dir, table, steps_scale, echo)
        _publish(table, records, parent, gates, budget.spent, purchases(out_dir), t0, echo)
    state.finished = True
    state.save()
    return table


def _diagnosis(world: WorldPaths, out_dir: str, state: MR.MainState, echo: Callable[[str], None]
               ) -> tuple[str, str | None]:
    """_diagnose_and_correct, or what it gave a main this one resumes."""
    done = state.done.get("diagnosis")
    if done:
        echo(f"diagnostic and correction: {done['diagnostic']}, {done['wrapper']} (made before the resume)")
        return done["diagnostic"], done["wrapper"]
    diag_path, wrapper = _diagnose_and_correct(world, out_dir, echo)
    state.mark("diagnosis", {"diagnostic": diag_path, "wrapper": wrapper})
    return diag_path, wrapper


def _evaluator(world: WorldPaths, out_dir: str, diagnosis: tuple[str, str | None], budget: LabelBudget,
               gates: G.GuardrailConfig, state: MR.MainState, echo: Callable[[str], None]
               ) -> tuple[Callable[..., None], Purchases]:
    """dev_eval and certify of a candidate as it finishes (while others still train), and its label
    purchase once the round's candidates have all trained (Purchases.settle, the most promising first);
    once per version over a main and its resumes."""
    base = {"diagnostic": diagnosis[0], "correction": diagnosis[1]}
    buyer = Purchases(world, out_dir, budget, gates, echo)

    def evaluate(name: str, s: dict, predictor: dict | None = None) -> None:
        """`predictor`: {"rm_dir", "correction"} of a later round's repaired reward model, which certify
        then uses on the policy's own labels (and not on the expert set it learnt from)."""
        v = str(s["model_version"])
        if state.done.get(f"evaluated/v{v}"):
            return
        inputs = {**base, **(predictor or {})}
        # a purchase a stop cut short is made again from its first look (buy_labels): counted once
        budget.spent -= MR.labels_in(os.path.join(out_dir, f"labels-v{v}.jsonl"))
        run_dev_eval(REG.version_uri(v), world.policy, world.reward_model, world.prompts_dev, world.expert_set,
                     run_name=f"dev_eval-{name}")
        expert_set: list[str] = []  # a verdict only if no labels follow (buy_labels)
        report = run_certify(version=v, world=world, echo=expert_set.append, **inputs)["report"]
        buyer.add(v, report, inputs, expert_set, round_of(name), lambda: state.mark(f"evaluated/v{v}"))
    return evaluate, buyer


def _publish(table: pd.DataFrame, records: list[dict], parent, gates: G.GuardrailConfig, labels_spent: int,
             bought: list[dict], t0: float, echo: Callable[[str], None]) -> None:
    """The story on main's run (its description, summary.md, the tables, the outcome metrics) and the front
    page; `bought`: the label ledger's purchases (labels.purchases)."""
    story = story_markdown(table) + rounds_markdown(records, table) + purchases_markdown(bought)
    loosened = G.non_default(gates)
    if loosened:  # a reader must not take a loosened gate's champion for the default gate's
        story = f"**Released under non-default guardrails: {', '.join(loosened)}**\n\n" + story
        T.set_tags({"rlhf.non_default": ", ".join(loosened)})
        echo(f"main: every release ran under non-default guardrails: {', '.join(loosened)}")
    T.set_description(story)
    view = publish_front_page(table, parent.info.experiment_id, parent.info.run_id, loosened)
    echo("MLflow UI: `.venv/bin/mlflow ui --app-name rlhf`, then http://127.0.0.1:5000 (the experiment's page "
         f"says who is champion); every candidate with its verdict: http://127.0.0.1:5000/{view}")
    T.log_text(story + "\nEvery column (each guardrail, dev proxy, checkpoint step): summary.csv, or "
               "full_summary.md.\n", "summary.md")
    T.log_text(markdown_table(table), "full_summary.md")
    T.log_text(table.to_csv(index=False), "summary.csv")
    if bought:
        T.log_table(pd.DataFrame([{k: r[k] for k in ("round", "purpose", "version", "labels")} | r["families"]
                                  for r in bought]), "labels_bought.json")
    T.log_metrics(_outcome_metrics(table) | {MN.MAIN + "seconds": time.perf_counter() - t0,
                                             MN.MAIN + "expert_labels": labels_spent}
                  | {MN.MAIN + k: v for k, v in purchase_metrics(bought).items()})


DECISIONS = ("promoted", "superseded", "refused")
"""A candidate's release decision (its version's `release.decision`, first word): the champion now, the
champion in its turn and then beaten (`superseded by vN`), or refused by a guardrail."""


def _outcome_metrics(table: pd.DataFrame) -> dict:
    """What a user charts across main runs: the champion's certified balanced quality (if this run
    made one), and the candidates per decision (`main/candidates_<decision>`, adding up to them)."""
    words = [str(d).split(" ", 1)[0] for d in table["decision"]] if len(table) else []
    out = {MN.MAIN + f"candidates_{d}": float(words.count(d)) for d in DECISIONS}
    if not len(table):
        return out
    champ = table[table["champion"]]
    if len(champ) and pd.notna(champ.iloc[0]["certified_balanced"]):
        out[MN.MAIN + "champion_certified_balanced"] = float(champ.iloc[0]["certified_balanced"])
    return out


def _diagnose_and_correct(world: WorldPaths, out_dir: str, echo: Callable[[str], None]) -> tuple[str, str | None]:
    """The gold-free diagnostic and its correction; returns (evidence JSON path, wrapper path or None
    when nothing was flagged)."""
    echo("diagnostic: auditing the reward model without expert labels")
    diag = run_diagnostic_step(world.reward_model, world.policy, world.prompts_train)
    diag_path = os.path.join(out_dir, "diagnostic.json")
    atomic_write_json(diag_path, diag)
    flagged = [f for f, r in diag["families"].items() if r["flag"]]
    echo(f"  flagged: {', '.join(flagged) or 'none'}")
    wrapper = os.path.abspath(os.path.join(out_dir, "correction.py"))
    rules = run_correction(diag, world.qa, wrapper)
    echo("  corrections: " + (", ".join(f"{r['family']} {SR.describe(r)} {r['bonus']:+.3f}"
                                        + (f" (labels {r['label_slope']:+.3f})" if r.get("label_slope") is not None else "")
                                        for r in rules) or "none"))
    return diag_path, wrapper if rules else None


def _ceiling_if_new_champion(world: WorldPaths, out_dir: str, table: pd.DataFrame, steps_scale: float,
                             echo: Callable[[str], None]) -> None:
    champion = REG.champion_version()
    if champion is None:
        return
    if not (len(table) and table["champion"].any()):
        echo(f"ceiling: skipped: the champion is version {champion.version} from an earlier run, and "
             "no candidate of this run beat it (beats_champion)")
        return
    _ceiling(world, out_dir, champion, table, steps_scale, echo)


CEILING_PROGRESS_EVERY = 10.0
"""Seconds between the ceiling run's progress lines (it trains for about a minute on the default world,
after the candidates)."""


def _ceiling(world: WorldPaths, out_dir: str, champion, table: pd.DataFrame, steps_scale: float,
             echo: Callable[[str], None]) -> None:
    """Train the champion's recipe on the oracle's true reward; report the champion's truth as a
    fraction of what that reaches (measurement only: release has already decided)."""
    name = recipe_of(champion.tags.get("recipe"))
    ov = next(job.overrides for job in candidate_jobs(None, steps_scale) if job.name == name)
    oracle = write_oracle_reward(world.root, os.path.abspath(os.path.join(out_dir, "oracle_reward.py")))
    # the same budget as the champion: its registered checkpoint's steps
    ov = {**ov, "steps": int(champion.tags.get("checkpoint_step") or ov["steps"]), "reward_wrapper": oracle,
          "save_every": 0}
    echo(f"ceiling: {name}'s recipe ({ov['steps']} steps) on the oracle's true reward")
    ckpt = os.path.join(out_dir, "ceiling_policy")  # main's own: an earlier main's ceiling is replaced
    run_train_rl(load_rl_config(world.config, ov), world=world, out=ckpt, run_name=f"ceiling-{name}",
                 register=False, tags={"rlhf.oracle": "true"}, echo=lambda m: None, progress=CEILING_PROGRESS_EVERY,
                 overwrite=True)
    ceiling_truth = run_grade_checkpoint(ckpt, world, run_name="grade-ceiling")["truth"]["truth/balanced"]
    champ_truth = float(table.loc[table["model_version"] == str(champion.version), "truth_balanced"].iloc[0])
    table.attrs["ceiling"] = {"recipe": name, "steps": ov["steps"], "ceiling_truth_balanced": ceiling_truth,
                              "champion_truth_balanced": champ_truth, "fraction": champ_truth / ceiling_truth}
    T.log_metrics({MN.MAIN + "ceiling/truth_balanced": ceiling_truth, MN.MAIN + "champion/truth_balanced": champ_truth,
                   MN.MAIN + "champion/ceiling_fraction": champ_truth / ceiling_truth})
