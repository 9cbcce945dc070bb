"""`main`: the whole story on one world, as a parent MLflow run with a child run per step.

world -> replay the seed's five historical runs -> gold-free diagnostic -> correction -> corrected
candidates (kl 0.1/800 and kl 0.05/1200 on the corrected reward, each registered at its latest
checkpoint that the expert set can still certify) -> dev_eval, certify and release of
every candidate, in order -> grade (the oracle's truth, never read by release) -> the champion's
recipe trained on the oracle's true reward (this world's ceiling for that budget) -> a summary table
built with pandas from the runs and registry versions it made.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from .files import atomic_write_json, check_writable
from .recipes import CORRECTED, SEED_HISTORY
from .reports import markdown_table
from .tracking import registry as REG
from .tracking import runs as T


def _recipes(wrapper: str | None, steps_scale: float) -> list[tuple[str, dict, str, dict]]:
    """(name, overrides, description, tags) for every candidate, history first."""
    out = [(n, ov, note, {"rlhf.history": "seed"}) for n, (ov, note) in SEED_HISTORY.items()]
    out += [(n, {**ov, "reward_wrapper": wrapper or None}, "Trained on the reward model minus the fitted shortcut "
             "corrections (diagnostic -> correction).", {"rlhf.corrected": "true"}) for n, ov in CORRECTED.items()]
    return [(n, dict(ov, steps=max(1, int(ov["steps"] * steps_scale))), d, t) for n, ov, d, t in out]


def run_main(world_dir: str, out_dir: str, steps_scale: float = 1.0, ceiling: bool = True,
             echo: Callable[[str], None] = print) -> pd.DataFrame:
    from .release_run import run_certify, run_grade, run_release
    from .steps import run_correction, run_dev_eval, run_diagnostic_step
    j = lambda *p: os.path.join(world_dir, *p)  # noqa: E731
    os.makedirs(check_writable(out_dir, "--out", directory=True), exist_ok=True)
    t0 = time.perf_counter()
    with T.tracked_run("main", {"world": os.path.abspath(world_dir), "steps_scale": steps_scale},
                       run_name="main") as parent:
        echo("diagnostic: auditing the reward model without expert labels")
        diag = run_diagnostic_step(j("reward_model"), j("policy"), j("data", "prompts_train.jsonl"))
        diag_path = os.path.join(out_dir, "diagnostic.json")
        atomic_write_json(diag_path, diag)
        flagged = [f for f, r in diag["families"].items() if r["flag"]]
        echo(f"  flagged: {', '.join(flagged) or 'none'}")
        wrapper = os.path.abspath(os.path.join(out_dir, "correction.py"))
        rules = run_correction(diag, j("reward_model", "train.jsonl"), wrapper)
        echo("  corrections: " + (", ".join(f"{r['family']} {_feature(r)} {r['bonus']:+.3f}" for r in rules) or "none"))
        jobs = []
        for name, ov, note, tags in _recipes("", steps_scale):
            corrected = name not in SEED_HISTORY
            if corrected:  # saved at each quarter; registered at the latest the expert set can certify
                ov = {**ov, "reward_wrapper": wrapper if rules else None,
                      "save_every": max(1, ov["steps"] // CHECKPOINTS)}
            jobs.append(TrainJob(name, ov, note, tags, select_certifiable=corrected))

        def evaluate(name: str, s: dict) -> None:  # as each candidate finishes, while others still train
            v = s["model_version"]
            run_dev_eval(REG.version_uri(v), j("policy"), j("reward_model"), j("data", "prompts_dev.jsonl"),
                         j("data", "gold_calib.jsonl"), run_name=f"dev_eval-{name}")
            run_certify(version=v, world=world_dir, correction=wrapper, diagnostic=diag_path, echo=echo)

        candidates = train_all(jobs, world_dir, parent.info.run_id, echo, on_done=evaluate)
        for name, s in candidates.items():  # in recipe order: each release compares with the champion so far
            run_release(s["model_version"], echo=echo)
        for name, s in candidates.items():
            run_grade(s["model_version"], world_dir, echo=lambda m: None)
        table = summary_table(parent.info.run_id)
        champion = REG.champion_version()
        if ceiling and champion is not None:
            if len(table) and table["champion"].any():
                _ceiling(world_dir, out_dir, champion, table, steps_scale, echo)
            else:
                echo(f"ceiling: skipped: the champion is version {champion.version} from an earlier run, and "
                     "no candidate of this run beat it (beats_champion)")
        T.log_text(markdown_table(table), "summary.md")
        T.log_text(table.to_csv(index=False), "summary.csv")
        T.log_metrics({"seconds": time.perf_counter() - t0})
    return table


CHECKPOINTS = 4  # a corrected candidate is saved at each quarter of its steps


@dataclass(frozen=True)
class TrainJob:
    """One candidate's train_rl run, as main hands it to a worker."""
    name: str
    overrides: dict
    description: str
    tags: dict
    select_certifiable: bool = False


def train_all(jobs: list[TrainJob], world_dir: str, parent_run_id: str, echo: Callable[[str], None],
              on_done: Callable[[str, dict], None] | None = None) -> dict[str, dict]:
    """Run every job as a child train_rl run of `parent_run_id`; returns {name: run summary} in job order.
    `on_done(name, summary)` runs here as each job finishes (in the parallel case while others train,
    on one thread so that it takes a core only when a worker has left one idle).

    With >= 2 torch threads the jobs run in that many worker processes of one thread each, longest
    first: two one-thread runs side by side get more done (~21 steps/s together on 2 cores) than one
    run with its partner process (~18; see partner.py).
    With one thread they run here, one after another.
    """
    import mlflow
    import torch

    from .runtime import configure_threads
    from .tracking.sweep_runs import absolute_tracking_uri, log_training_inputs
    workers = min(configure_threads(), len(jobs))
    # MLflow inserts a dataset row on first use without a lock: log the prompt files here first
    log_training_inputs({os.path.join(world_dir, "data", "prompts_train.jsonl")})
    experiment = mlflow.get_experiment(mlflow.get_run(parent_run_id).info.experiment_id).name
    env = {"tracking_uri": absolute_tracking_uri(), "experiment_name": experiment,
           "parent_run_id": parent_run_id, "world_dir": os.path.abspath(world_dir)}
    if workers < 2:
        out = {}
        for job in jobs:  # nested under main's active run
            out[job.name] = _train_job(env, job, echo)[1]
            if on_done is not None:
                on_done(job.name, out[job.name])
        return out
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    done: dict[str, dict] = {}
    order = sorted(jobs, key=lambda job: -job.overrides["steps"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_enter_worker, initargs=(env,)) as pool:
        futures = [pool.submit(_train_job, env, job) for job in order]
        echo(f"training {len(jobs)} candidates, {workers} side by side (one thread each)")
        try:
            for fut in as_completed(futures):
                name, summary, lines = fut.result()
                for line in lines:
                    echo(line)
                done[name] = summary
                if on_done is not None:
                    on_done(name, summary)
        except BaseException:
            for fut in futures:
                fut.cancel()
            # the running ones get SIGTERM: each worker's run ends KILLED (see runtime.handle_signals)
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
            raise
        finally:
            torch.set_num_threads(threads)
    return {job.name: done[job.name] for job in jobs}


def _enter_worker(env: dict) -> None:
    """A worker process: one torch thread, main's store and experiment, never the launcher's run."""
    from .tracking.sweep_runs import enter_worker
    enter_worker(env["tracking_uri"], env["experiment_name"], 1)


def _train_job(env: dict, job: TrainJob, echo: Callable[[str], None] | None = None
               ) -> tuple[str, dict, list[str]]:
    """Train one job as a child of main's run; returns (name, summary, the lines it would print)."""
    from .rl_config_io import load_rl_config, recipe_overrides
    from .rl_run import run_train_rl
    lines: list[str] = []
    say = echo or lines.append
    world_dir = env["world_dir"]
    say(f"train_rl {job.name} (kl {job.overrides['kl_coef']:g}, {job.overrides['steps']} steps)")
    cfg = load_rl_config(os.path.join(world_dir, "configs", "default.json"), recipe_overrides(job.overrides))
    select = latest_certifiable(world_dir, say) if job.select_certifiable else None
    summary = run_train_rl(cfg, world_dir=world_dir, run_name=job.name, description=job.description,
                           tags={**job.tags, "mlflow.parentRunId": env["parent_run_id"]},
                           echo=lambda m: None, progress=False, select=select)
    say(f"  {job.name}: {cfg.steps} steps in {summary['seconds']:.0f} s")
    return job.name, summary, lines


def latest_certifiable(world_dir: str, echo: Callable[[str], None]) -> Callable[[list[tuple[int, str]]], int]:
    """A checkpoint chooser for run_train_rl: the latest checkpoint whose every family the expert set
    can still certify (certify.weight_support: ESS and weight tail on the expert responses, population
    ESS from the policy's own samples; labels are not read, so the choice does not bias the certified
    estimate); the final one when none can be."""
    from . import certify as C
    from . import data as D
    from . import model as M
    reference = M.load_policy(os.path.join(world_dir, "policy"))[0]
    gold = D.read_jsonl(os.path.join(world_dir, "data", "gold_calib.jsonl"), labelled=True)

    def select(saved: list[tuple[int, str]]) -> int:
        for step, path in reversed(saved):
            support = C.weight_support(M.load_policy(path)[0], reference, gold)
            short = {f: r["reason"] for f, r in support.items() if not r["certifiable"]}
            if not short:
                echo(f"  registering step {step}: every family certifiable")
                return step
            echo(f"  step {step}: " + "; ".join(f"{f} {why}" for f, why in short.items()))
        echo("  no checkpoint certifiable: registering the final one")
        return saved[-1][0]
    return select


def _ceiling(world_dir, out_dir, champion, table, steps_scale, echo) -> None:
    """Train the champion's recipe on the oracle's true reward; report the champion's truth as a
    fraction of what that reaches (measurement only: release has already decided)."""
    from .release_run import run_grade_checkpoint
    from .rl_config_io import load_rl_config, recipe_overrides
    from .rl_run import run_train_rl
    from .world.oracle import write_oracle_reward
    name = champion.tags.get("recipe")
    ov = next(ov for n, ov, _, _ in _recipes(None, steps_scale) if n == name)
    oracle = write_oracle_reward(world_dir, os.path.abspath(os.path.join(out_dir, "oracle_reward.py")))
    # the same budget as the champion: its registered checkpoint's steps
    ov = {**ov, "steps": int(champion.tags.get("checkpoint_step") or ov["steps"]), "reward_wrapper": oracle}
    echo(f"ceiling: {name}'s recipe ({ov['steps']} steps) on the oracle's true reward")
    cfg = load_rl_config(os.path.join(world_dir, "configs", "default.json"), recipe_overrides(ov))
    ckpt = os.path.join(out_dir, "ceiling_policy")  # main's own: an earlier main's ceiling is replaced
    run_train_rl(cfg, world_dir=world_dir, out=ckpt, run_name=f"oracle-reward-{name}", register=False,
                 tags={"rlhf.oracle": "true"}, echo=lambda m: None, progress=False, overwrite=True)
    truth = run_grade_checkpoint(ckpt, world_dir, run_name=f"grade-oracle-reward-{name}")["truth"]
    ceiling_truth = truth["truth/balanced"]
    champ_truth = float(table.loc[table["model_version"] == str(champion.version), "truth_balanced"].iloc[0])
    table.attrs["ceiling"] = {"recipe": name, "steps": ov["steps"], "ceiling_truth_balanced": ceiling_truth,
                              "champion_truth_balanced": champ_truth, "fraction": champ_truth / ceiling_truth}
    T.log_metrics({"ceiling/truth_balanced": ceiling_truth, "champion/truth_balanced": champ_truth,
                   "champion/ceiling_fraction": champ_truth / ceiling_truth})


def _feature(rule: dict) -> str:
    return rule.get("token") or "+".join(rule.get("tokens", []))


def summary_table(parent_run_id: str) -> pd.DataFrame:
    """Per registered candidate made under `parent_run_id`: dev proxy, certified balanced quality
    with its interval, every guardrail, the release decision and the oracle's truth."""
    runs = T.search_runs(f"tags.mlflow.parentRunId = '{parent_run_id}'")
    by_step = {step: frame for step, frame in runs.groupby("tags.rlhf.step")} if len(runs) else {}
    train_ids = set(by_step.get("train_rl", pd.DataFrame(columns=["run_id"]))["run_id"])
    versions = [v for v in REG.client().search_model_versions(f"name = '{REG.REGISTERED_MODEL}'")
                if v.run_id in train_ids]
    champion = REG.champion_version()

    def latest(step: str, version: str, key: str):
        frame = by_step.get(step)
        if frame is None or key not in frame:
            return None
        col = "params.model_version" if step != "dev_eval" else "params.policy"
        want = str(version) if step != "dev_eval" else REG.version_uri(version)
        rows = frame[frame[col] == want] if col in frame else frame.iloc[0:0]
        return None if rows.empty or pd.isna(rows.iloc[0][key]) else rows.iloc[0][key]

    rows = []
    order = [name for name, _, _, _ in _recipes(None, 1.0)]  # the order main releases them in
    for v in sorted(versions, key=lambda v: (order.index(v.tags.get("recipe")) if v.tags.get("recipe") in order
                                             else len(order), int(v.version))):
        row = {"candidate": v.tags.get("recipe"), "model_version": str(v.version),
               "step": int(v.tags["checkpoint_step"]) if v.tags.get("checkpoint_step") else None,
               "dev_proxy": latest("dev_eval", v.version, "metrics.proxy_mean"),
               "certified_balanced": latest("certify", v.version, "metrics.certified/balanced"),
               "certified_lo": latest("certify", v.version, "metrics.certified_lo/balanced"),
               "certified_hi": latest("certify", v.version, "metrics.certified_hi/balanced")}
        tags = REG.get_version(v.version).tags
        for k, val in sorted(tags.items()):
            if k.startswith("guardrail."):
                row[k.split(".", 1)[1]] = val.split(":", 1)[0]
        row["decision"] = tags.get("release.decision")
        row["champion"] = champion is not None and str(champion.version) == str(v.version)
        row["truth_balanced"] = latest("grade", v.version, "metrics.truth/balanced")
        rows.append(row)
    return pd.DataFrame(rows)
