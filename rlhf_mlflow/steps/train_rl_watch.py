"""The over-optimisation watch (decisions/watch.py) as train_rl's `on_watch` callback, inside the run:
it logs `watch/...` on the training step axis (the Gao fits, once, as a table and a figure), tags the run when a family passes its peak
(`rlhf.watch.past_peak`), keeps the checkpoint with the best estimated balanced truth, stops the run
under early_stop=stop, and draws the Gao fits figure at the end. Each checkpoint carries the watch's
state and its best policy so far, so that a resumed run's watch goes on as if it had never stopped."""
from __future__ import annotations

import json
import logging
import os
import shutil

from rlhf_mlflow.core import files as F
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core.reward_wrapper import load_wrapper
from rlhf_mlflow.decisions import watch as W
from rlhf_mlflow.evidence.watch import PolicyWatch
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.training.rl_config import RLConfig

log = logging.getLogger(__name__)
FIGURE, FITS = "figures/gao_fits.png", "watch_gao_fits.json"
WATCH_FILES = STATE, BEST = "watch_state.json", "watch_best"
"""In a checkpoint directory: the watch's state (Watch.state and the best step) and its best policy
(for a resume; a registered model leaves them out)."""


class RunWatch:
    """`on_watch(step, policy)` for one train_rl run; `best` is (step, checkpoint directory) once a
    point was best so far."""

    def __init__(self, cfg: RLConfig, logger, ckpt_dir: str, watch_cfg: W.WatchConfig = W.WatchConfig(),
                 proposal: bool = False, name: str = "train_rl"):
        """`proposal`: keep the watch's proposal (Watch.proposal_step, vouched for or not) as the best
        checkpoint instead of its best vouched-for point (Watch.best_step). `name` (the run's recipe)
        opens each warning: `main` trains several candidates at once."""
        reference = M.load_policy(cfg.policy_ref)[0]
        rm = R.load_rm(cfg.reward_model)[0]
        wrapper = load_wrapper(cfg.watch_correction or cfg.reward_wrapper)
        gold = D.read_jsonl(cfg.watch_gold, labelled=True, scale=D.EXPERT)
        self.cfg, self.logger, self.name, self.best_dir = cfg, logger, name, os.path.join(ckpt_dir, BEST)
        self.watch = PolicyWatch(reference, rm, wrapper, gold, watch_cfg)
        self.best: tuple[int, str] | None = None
        self.choose = self.watch.proposal_step if proposal else self.watch.best_step
        self.blind: dict[str, str] = {}

    def __call__(self, step: int, policy: M.Policy) -> str:
        pt = self.watch.observe(step, policy)
        self.logger(step, MN.prefixed(MN.WATCH, self.watch.metrics(pt)))
        blind = {f: pt.reason[f] for f in self.watch.families if not W.is_vouched(pt, f)}
        if blind.keys() != self.blind.keys():  # which families the expert set no longer vouches for, and why
            T.set_tags({"rlhf.watch.unvouched": "; ".join(f"{f}@{step} ({why})" for f, why in blind.items())
                        or f"none since step {step}"})
            self.blind = blind
        if self.choose() == step:  # the policy and its step replace the earlier best together
            with F.atomic_dir(self.best_dir) as staging:
                M.save_policy(policy, policy.cfg, staging)
            self.best = (step, self.best_dir)
        if not pt.alarms or self.cfg.early_stop == "off":
            return "continue"
        fired = ", ".join(f"{f}@{s}" for f, s in self.watch.fired.items())
        T.set_tags({"rlhf.watch.past_peak": fired,
                    "rlhf.watch.why": "; ".join(f"{f}: {why}" for f, why in self.watch.why.items())})
        why = "; ".join(f"{f}: {self.watch.why[f]}" for f in pt.alarms)
        log.warning("%s: step %d: past its peak by the watch: %s (so far: %s)", self.name, step, why, fired)
        if self.cfg.early_stop == "stop":
            kept = f"best estimated balanced truth at step {self.best[0]}" if self.best else \
                "no point where the expert set vouched for every family"
            T.set_tags({"rlhf.watch.stopped": f"step {step}: {', '.join(pt.alarms)} past its peak ({why}); {kept}"})
            return "stop"
        return "continue"

    def save(self, checkpoint: str) -> None:
        """Into a checkpoint directory being written (whole or not at all: files.atomic_dir): the
        watch's state and, when there is one, its best policy so far."""
        with open(os.path.join(checkpoint, STATE), "w") as f:
            json.dump({**self.watch.state(), "best_step": self.best[0] if self.best else None}, f, default=float)
        if self.best is not None:
            shutil.copytree(self.best[1], os.path.join(checkpoint, BEST))

    def restore(self, checkpoint: str) -> None:
        """Go on from what `save` put into the checkpoint a run resumes from (a checkpoint without it,
        from before the watch kept its state, starts the watch afresh, with a warning)."""
        path = os.path.join(checkpoint, STATE)
        if not os.path.exists(path):
            log.warning("the checkpoint holds no watch state: the watch starts afresh at the resumed step")
            return
        with open(path) as f:
            state = json.load(f)
        self.watch.restore(state)
        if state["best_step"] is not None:
            with F.atomic_dir(self.best_dir) as staging:
                shutil.copytree(os.path.join(checkpoint, BEST), staging, dirs_exist_ok=True)
            self.best = (state["best_step"], self.best_dir)

    def finish(self) -> None:
        """The fits (figure, table `watch_gao_fits.json`, tag `rlhf.watch.peaks`: a peak's KL, or
        'no peak in range') and the best checkpoint as artifacts (after training, in the run)."""
        if not self.watch.points:
            return
        import pandas as pd

        from rlhf_mlflow.steps.figures import gao_fits
        fits = self.watch.fits()
        rows = W.fit_rows(fits, self.watch.points)
        T.log_figure(gao_fits(self.watch.points, fits, self.watch.fired), FIGURE)
        T.log_table(pd.DataFrame(rows), FITS)
        T.set_tags({"rlhf.watch.peaks": "; ".join(f"{r['family']}: {r['peak']}" for r in rows)})
        T.set_tags({"rlhf.watch.best_step": str(self.best[0]) if self.best else
                    "none: the expert set vouched for every family at no trained point"})
        if self.best is not None:
            T.log_artifact(self.best[1], "checkpoints/watch_best")
