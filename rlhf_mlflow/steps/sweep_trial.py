"""One trial of a recipe sweep (steps/sweep.py), run inside a Ray worker.

A trial's run is its train_rl run (params, per-family curves, checkpoints, a registered
version of `rlhf-policy`), tagged with the sweep's parent run id; after training the same run gets
the trial's dev evaluation (`trial/dev/<metric>/<family>`) and every release guardrail
(`trial/guardrail/<name>` = 1 or 0, the reasons in tags); its certification is a certify run nested under it, which tags the
version as `rlhf-mlflow certify` does, so `rlhf-mlflow release --model-version V` can act on the
sweep's best trial as is.

`run_trial` runs inside a Ray worker: everything it needs travels in a picklable TrialContext.
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field

from rlhf_mlflow.core.config import from_dict
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions import guardrails as G
from rlhf_mlflow.steps.certify import run_certify
from rlhf_mlflow.steps.dev_eval import run_dev_eval
from rlhf_mlflow.steps.ray_tune import trial_name
from rlhf_mlflow.steps.train_rl import run_train_rl
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.workers import enter_worker
from rlhf_mlflow.training.batch_run import run_together
from rlhf_mlflow.training.batched import Seat
from rlhf_mlflow.training.rl_config import RLConfig

log = logging.getLogger(__name__)
DEV_PREFIX = "dev_"


@dataclass(frozen=True)
class TrialContext:
    tracking_uri: str
    """Where every trial logs (absolute: trials run in other processes, maybe on other machines)."""
    experiment_name: str
    parent_run_id: str
    """The sweep's parent run; each trial's run is tagged as its child."""
    world_root: str
    """The world: dev prompts, expert set, reference policy, reward model."""
    base: dict
    """The resolved RLConfig (as a dict) that each trial's recipe overrides."""
    threads: int = 1
    """torch threads per trial."""
    register: bool = True
    diagnostic: dict | None = None
    """Gold-free diagnostic evidence; certify counts its flagged shortcuts (marker-collapse guardrail)."""
    champion: dict | None = None
    """The current champion's certification report (beats-champion guardrail), or None."""
    guardrails: dict = field(default_factory=dict)
    """GuardrailConfig overrides."""


def run_trials(ctx: TrialContext, recipes: list[dict]) -> list[dict]:
    """A Tune trial: its recipes trained together as one batch (each in its own thread; one alone), then
    each evaluated, certified and checked; their rows of the sweep table ({"error": ...} for one that
    failed while the others went on; a lone recipe's error fails the Tune trial)."""
    enter_worker(ctx.tracking_uri, ctx.experiment_name, ctx.threads)
    if len(recipes) == 1:
        return [run_trial(ctx, recipes[0])]
    out = run_together([lambda seat, r=r: run_trial(ctx, r, seat) for r in recipes])
    return [{"error": f"{type(o).__name__}: {o}"} if isinstance(o, BaseException) else o for o in out]


def run_trial(ctx: TrialContext, recipe: dict, seat: Seat | None = None) -> dict:
    """Train (as a member of a batch, with `seat`), evaluate, certify and check one recipe; returns its
    row of the sweep table."""
    cfg = from_dict(RLConfig, {**ctx.base, **recipe}, f"trial {recipe}")
    name = trial_name(recipe)
    world = WorldPaths(ctx.world_root)
    tags = {"mlflow.parentRunId": ctx.parent_run_id, "rlhf.sweep_run": ctx.parent_run_id, "rlhf.trial": name}
    with tempfile.TemporaryDirectory() as tmp:
        policy_dir = os.path.join(tmp, "policy")
        summary = run_train_rl(cfg, world=world, out=policy_dir, run_name=name, register=ctx.register,
                               echo=log.info, progress=False, tags=tags, seat=seat)
        with T.reopened_run(summary["run_id"]):  # dev_eval and certify runs nest under the trial's run
            dev = run_dev_eval(policy_dir, cfg.policy_ref, cfg.reward_model, world.prompts_dev, world.expert_set,
                               run_name=f"dev_eval-{name}")
            T.log_metrics({MN.TRIAL + MN.DEV + k: v for k, v in dev.items()})
            report, gates = certify_trial(policy_dir, cfg, ctx, summary.get("model_version"))
    row = {"run_id": summary["run_id"], "model_version": summary.get("model_version"),
           "seconds": summary["seconds"], "proxy/balanced": summary.get("proxy/balanced"),
           "kl/balanced": summary.get("kl/balanced"),
           **{DEV_PREFIX + k: dev[k] for k in ("proxy/balanced", "kl/balanced", "proxy/pilot") if k in dev}}
    row.update(_certified_columns(report))
    row.update({f"guardrail/{k}": bool(ok) for k, (ok, _) in gates.items()})
    row["failed_guardrails"] = "; ".join(f"{k}: {why}" for k, (ok, why) in gates.items() if not ok)
    return row


def certify_trial(policy_dir: str, cfg, ctx: TrialContext, version: str | None
                  ) -> tuple[dict | None, dict[str, tuple[bool, str]]]:
    """Certify the trial's policy (a certify run, child of the trial's run, that tags the version as
    `rlhf-mlflow certify` does, so release can act on it), then evaluate every release guardrail on
    the trial's run. Returns (report, {guardrail: (passed, reason)})."""
    world = WorldPaths(ctx.world_root)
    res = run_certify(version=version, policy=None if version else policy_dir, reference=cfg.policy_ref,
                      gold=world.expert_set, rm_dir=cfg.reward_model,
                      correction=cfg.reward_wrapper, diagnostic=ctx.diagnostic,
                      pilot_prompts=world.prompts_dev, echo=log.info,
                      tags={"rlhf.sweep_run": ctx.parent_run_id})
    report = res["report"]
    gates = G.evaluate(report, G.GuardrailConfig.from_dict(dict(ctx.guardrails)), ctx.champion)
    T.log_metrics({f"{MN.TRIAL}guardrail/{k}": float(ok) for k, (ok, _) in gates.items()})
    T.log_json_artifact({k: {"pass": ok, "reason": why} for k, (ok, why) in gates.items()}, "guardrails.json")
    T.set_tags({"rlhf.certification_run": res["run_id"],
                     **{f"guardrail.{k}": f"{'pass' if ok else 'fail'}: {why}"[:4900] for k, (ok, why) in gates.items()}})
    return report, gates


def _certified_columns(report: dict | None) -> dict:
    if report is None:
        return {"certified/balanced": None}
    b = report["balanced"]
    return {"certified/balanced": b.get("estimate"), "certified_lo/balanced": b.get("lo"),
            "certified_hi/balanced": b.get("hi"), "gain/balanced": b.get("gain"),
            "reference_quality/balanced": b.get("reference")}


