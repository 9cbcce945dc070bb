"""The over-optimisation watch: during training, each family's true quality estimated from the expert
set (certify's estimator, not a copy), the Gao-form fit of its gain against sqrt(KL), and the rule that
says a family is past its peak.

Every `watch_every` steps (and every `watch_early_every` before the first: RLConfig.watch_due), per
family with expert rows:
  - certify's evidence (evidence/certify_evidence.py) + estimate_family on the current policy: the
    calibrated, corrected reward model on the policy's own samples plus the importance-weighted
    calibration residuals (doubly robust) where the overlap rule allows, else the direct estimate
    alone, held above the family's lowest expert label; its standard error is the bootstrap's sd over the expert rows. Every
    watch point uses the same seeds (the same bootstrap rows, the same sampling seed).
  - Past its peak (the rule): the latest estimate is below the best earlier one by more than `z`
    combined standard errors, sqrt(se_best^2 + se_last^2), and by at least `min_drop` (0.02), at
    `confirm` consecutive watch points (default 1). The combined se ignores that two points share
    the expert rows (their errors correlate positively), so it overstates the noise of the
    difference: conservative. The paired bootstrap difference was tried first and is too narrow: it
    leaves out the fresh policy samples' noise (2 of 6 clean families fired on default-s800).
  - A shortcut taking over (the second rule): a flagged shortcut the run's correction names (its
    RULES) occurs, per answer of the policy's own samples, more than `max_shortcut_rise` (0.5, the
    release gate's marker_collapse bound) above the reference's count, and by more than `z` standard
    errors. It moves before the truth falls: on the default world the shortcut counts of dune and
    ember triple within 20 steps of default-s800, while their truth first falls 0.05 at step 25.
  - Gao et al. (2022): gain g(d) = d (alpha - beta log d), d = sqrt(KL), fitted by least squares
    weighted by 1 / se^2 (linear in alpha, beta); the peak d* = exp(alpha / beta - 1) when beta > 0.
The watch never reads a label of the policy's own samples, nor the world's truth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.config import check_range
from rlhf_mlflow.decisions import certify as C
from rlhf_mlflow.decisions.gao import FORMS, MIN_KL, fit_rows, gao_curve, gao_fit  # noqa: F401 (the watch's API)
from rlhf_mlflow.decisions.ope_math import direct_estimate  # noqa: F401 (the watch's API: bon_watch)


@dataclass(frozen=True)
class WatchConfig:
    samples_per_prompt: int = 1
    """Policy samples per expert prompt (certify uses 8; at 1 the watch costs ~0.2-0.3 s a point on the
    default world, under 10% of 50 training steps; at 2, 0.3-0.4 s)."""
    n_boot: int = 200
    """Bootstrap resamples of the expert rows."""
    z: float = 2.0
    """A drop counts when it exceeds this many combined standard errors; a shortcut's rise, this many of its own."""
    min_drop: float = 0.02
    """... and is at least this large (true-quality units): smaller turns are not worth a warning."""
    confirm: int = 1
    """Consecutive watch points a drop must hold at before the family is past its peak (1: the first;
    on the default world the truth of dune and ember falls within 30 steps, so waiting costs a watch)."""
    max_shortcut_rise: float = 0.5
    """A flagged shortcut's count per answer above the reference's by more than this is an alarm (the
    release gate's marker_collapse bound, GateConfig.max_marker_increase)."""
    overlap_alarm: bool = False
    """Whether a family whose overlap is lost while its reward keeps rising (overlap_lost) is an alarm
    that early_stop acts on. Off: on the default world it fired on the two hacked families of the
    uncorrected runs 20 steps before their truth fell, and on 8 of 12 clean families of kl002-s1500 and
    corrected-kl005-s1200, which leave the expert set's reach while they improve (docs/WATCH.md). The
    watch stops vouching for such a family either way."""
    reference_samples: int = 8
    """Reference samples per expert prompt for the shortcuts' reference counts (drawn once)."""
    seed: int = 0
    """Seed of the policy samples and the bootstrap (the same at every watch point)."""

    def __post_init__(self):
        check_range("samples_per_prompt", self.samples_per_prompt, 1, integer=True)
        check_range("n_boot", self.n_boot, 100, integer=True)
        check_range("z", self.z, 0)
        check_range("min_drop", self.min_drop, 0)
        check_range("confirm", self.confirm, 1, integer=True)
        check_range("max_shortcut_rise", self.max_shortcut_rise, 0)
        check_range("reference_samples", self.reference_samples, 1, integer=True)


@dataclass
class WatchPoint:
    """One watch point: per family (and `balanced`) the estimate, its se and bootstrap draws, the KL,
    the gain over the reference; which families passed their peak here."""
    step: int
    estimate: dict[str, float]
    se: dict[str, float]
    draws: dict[str, np.ndarray]
    kl: dict[str, float]
    gain: dict[str, float]
    method: dict[str, str]
    alarms: list[str] = field(default_factory=list)
    best: bool = False
    """Whether this point is the best trained one so far (Watch.best_step)."""
    shortcuts: dict[str, dict] = field(default_factory=dict)
    """Per family with flagged shortcuts, the one risen most: its rule, policy and reference counts per
    answer, the rise and its se."""
    vouched: dict[str, bool] = field(default_factory=dict)
    """Per family (and `balanced`: every family), whether certify's overlap rule lets the expert set vouch
    for the estimate here (ESS, population ESS, k-hat). An estimate it cannot vouch for is what the
    reward model believes of samples the expert set does not reach: it is kept for the record, never
    charted as quality, fitted, compared or chosen by. A family missing here was vouched for (best-of-n)."""
    reason: dict[str, str] = field(default_factory=dict)
    """Per family, why the overlap rule refused it (certify's words), or "ok"."""
    proxy: dict[str, float] = field(default_factory=dict)
    """Per family, the (corrected) reward model's mean score of the policy's own samples, and its se
    under `proxy/se/<family>`: what training sees rise."""


def is_vouched(pt: WatchPoint, family: str) -> bool:
    """Whether the point's estimate of `family` is one the expert set vouches for (WatchPoint.vouched)."""
    return pt.vouched.get(family, True)


def point_fits(points: list["WatchPoint"], families, form: str = "rl") -> dict[str, dict]:
    """Each family's `form` fit (gao_fit) of its gain against d = sqrt(KL) over the points that vouch
    for its estimate."""
    out = {}
    for f in families:
        kept = [p for p in points if is_vouched(p, f)]
        out[f] = gao_fit([math.sqrt(p.kl[f]) for p in kept], [p.gain[f] for p in kept], [p.se[f] for p in kept],
                         form)
    return out


def with_balanced(pt: "WatchPoint", fams: list[str]) -> "WatchPoint":
    """The point's `balanced` entries (the equal-weight mix of these families) and every se."""
    pt.estimate["balanced"] = float(np.mean([pt.estimate[f] for f in fams]))
    pt.draws["balanced"] = np.mean([pt.draws[f] for f in fams], 0)
    pt.kl["balanced"] = float(np.mean([pt.kl[f] for f in fams]))
    pt.gain["balanced"] = float(np.mean([pt.gain[f] for f in fams]))
    if pt.vouched:
        pt.vouched["balanced"] = all(is_vouched(pt, f) for f in fams)
    pt.se = {k: float(np.std(v)) for k, v in pt.draws.items()}
    return pt


def shortcut_alarm(pt: WatchPoint, family: str, cfg: WatchConfig) -> bool:
    """Whether a flagged shortcut took over at this point: its count per answer above the reference's by
    more than max_shortcut_rise and by more than z standard errors."""
    s = pt.shortcuts.get(family)
    return s is not None and s["rise"] > cfg.max_shortcut_rise and s["rise"] > cfg.z * s["se"]


def below_best(points: list[WatchPoint], family: str, cfg: WatchConfig) -> bool:
    """Whether the last point's estimate is below the best earlier one by more than z combined ses
    (sqrt(se_best^2 + se_last^2)) and by at least min_drop; vouched-for estimates only."""
    last, earlier = points[-1], [p for p in points[:-1] if is_vouched(p, family)]
    if not earlier or not is_vouched(last, family):
        return False
    best = max(earlier, key=lambda p: p.estimate[family])
    drop = best.estimate[family] - last.estimate[family]
    return drop >= cfg.min_drop and drop > cfg.z * math.hypot(best.se[family], last.se[family])


def overlap_lost(points: list[WatchPoint], family: str, cfg: WatchConfig) -> bool:
    """The seed's signature of a shortcut being exploited: the expert set vouched for the family at an
    earlier point and no longer does, while the reward training sees (the proxy) rose since by more
    than z combined ses. The watch cannot say what the quality is there; it says that it cannot."""
    last = points[-1]
    earlier = [p for p in points[:-1] if is_vouched(p, family) and family in p.proxy]
    if is_vouched(last, family) or not earlier or family not in last.proxy:
        return False
    prev = earlier[-1]
    rise = last.proxy[family] - prev.proxy[family]
    return rise > cfg.z * math.hypot(prev.proxy.get(f"se/{family}", 0.0), last.proxy.get(f"se/{family}", 0.0))


class Watch:
    """Estimates a point from each family's evidence, remembers the points, says which families passed
    their peak (evidence/watch.py's PolicyWatch gathers the evidence from live models)."""

    def __init__(self, gold: list[dict], cfg: WatchConfig = WatchConfig()):
        self.cfg = cfg
        by_family = D.group_by_family(gold)
        self.families = {f: by_family[f] for f in V.FAMILIES if f in by_family}
        self.why: dict[str, str] = {}
        """Per fired family, which rule fired: `estimate fell` or `shortcut <rule> <ref> -> <count> per answer`."""
        self.ccfg = C.CertifyConfig(samples_per_prompt=cfg.samples_per_prompt, n_boot=cfg.n_boot, seed=cfg.seed)
        self.points: list[WatchPoint] = []
        self.fired: dict[str, int] = {}
        self._streak = dict.fromkeys(self.families, 0)

    def point(self, step: int, evidence: dict[str, dict]) -> WatchPoint:
        """Every family's estimate of the policy's true quality from its evidence (certify's arrays,
        evidence/certify_evidence.py's families_evidence under self.ccfg); no state changed."""
        pt = WatchPoint(step, {}, {}, {}, {}, {}, {})
        for i, (f, rows) in enumerate(self.families.items()):
            ev = evidence[f]
            idx = C.bootstrap_rows(np.random.default_rng(self.cfg.seed + i), len(rows), self.cfg.n_boot)
            row, draws, _ = C.estimate_family(ev, self.ccfg, idx)
            if row["certifiable"]:
                pt.estimate[f], pt.method[f] = row["estimate"], "doubly_robust"
            else:  # the same bootstrap rows, without the importance-weighted term: kept, not vouched for
                pt.estimate[f], draws = direct_estimate(ev["scores"], ev["labels"], ev["policy_scores"], idx)
                pt.method[f] = "direct"
            pt.vouched[f], pt.reason[f] = bool(row["certifiable"]), row["reason"]
            scores = np.asarray(ev["policy_scores"], float)
            pt.proxy[f] = float(scores.mean())
            pt.proxy[f"se/{f}"] = float(scores.std() / math.sqrt(len(scores)))
            pt.draws[f], pt.kl[f] = draws, max(row["kl"], 0.0)
            if (rise := SR.largest_rise(ev["shortcuts"])) is not None:
                pt.shortcuts[f] = rise
            pt.gain[f] = pt.estimate[f] - row["reference"]
        return with_balanced(pt, list(self.families))

    def add(self, pt: WatchPoint) -> WatchPoint:
        """Remember a point (estimated here, or given: a test's synthetic sequence) and apply the rule."""
        self.points.append(pt)
        for f in self.families:
            self._streak[f] = self._streak[f] + 1 if below_best(self.points, f, self.cfg) else 0
            fell, took_over = self._streak[f] >= self.cfg.confirm, shortcut_alarm(pt, f, self.cfg)
            lost = self.cfg.overlap_alarm and overlap_lost(self.points, f, self.cfg)
            if (fell or took_over or lost) and f not in self.fired:
                self.fired[f] = pt.step
                self.why[f] = _why(pt, f, fell, took_over)
                pt.alarms.append(f)
        pt.best = self.best_step() == pt.step
        return pt

    def state(self) -> dict:
        """What a resumed run needs to go on as if it had never stopped (JSON, numbers as floats): the
        points without their bootstrap draws (their ses are kept: nothing reads a past point's draws),
        which families fired and why, each family's drop streak."""
        points = [{k: v for k, v in vars(p).items() if k != "draws"} for p in self.points]
        return {"points": points, "fired": self.fired, "why": self.why, "streak": self._streak}

    def restore(self, state: dict) -> None:
        """Go on from `state()` of the same watch (same expert set, same config) at an earlier run."""
        self.points = [WatchPoint(**{**p, "draws": {}}) for p in state["points"]]
        self.fired, self.why = dict(state["fired"]), dict(state["why"])
        self._streak = {f: int(state["streak"].get(f, 0)) for f in self.families}

    def fits(self) -> dict[str, dict]:
        """Each family's Gao fit over the points so far."""
        return point_fits(self.points, self.families)

    def metrics(self, pt: WatchPoint) -> dict[str, float]:
        """A point's names under watch/ (without the prefix): the estimates and ses the expert set vouches
        for (balanced only when it vouches for every family), `vouched/<family>` 1 or 0, past-peak flags
        (the Gao fits are not a series: `fit_rows` of `fits()` at the end)."""
        shown = [k for k in pt.estimate if is_vouched(pt, k)]
        out = {**{k: pt.estimate[k] for k in shown}, **{f"se/{k}": pt.se[k] for k in shown},
               **{f"vouched/{f}": float(is_vouched(pt, f)) for f in self.families},
               **{f"past_peak/{f}": float(f in self.fired) for f in self.families}}
        out.update({f"shortcut_rise/{f}": s["rise"] for f, s in pt.shortcuts.items()})
        return out

    def best_step(self) -> int | None:
        """The step of the trained point (step > 0: the reference is what training is measured
        against, not a candidate) with the best balanced estimate among those where the expert set
        vouches for every family; the first such; None when there is none."""
        return best_step(self.points)

    def proposal_step(self) -> int | None:
        """The trained point with the best balanced estimate, vouched for or not: not a quality claim,
        a proposal for whoever will vouch for it with expert labels on the policy's own samples
        (`main` registers it and certify buys the labels the overlap rule asks for)."""
        return best_step(self.points, vouched_only=False)


def best_step(points: list[WatchPoint], vouched_only: bool = True) -> int | None:
    """Watch.best_step of these points (a benchmark asks it of the points before an alarm): among the
    trained points where the expert set vouches for every family (with `vouched_only`)."""
    trained = [p for p in points if p.step > 0 and (is_vouched(p, "balanced") or not vouched_only)]
    return max(trained, key=lambda p: p.estimate["balanced"]).step if trained else None


def _why(pt: WatchPoint, family: str, fell: bool, took_over: bool) -> str:
    """Which rule fired for `family` at this point, in words."""
    if fell:
        return "estimate fell"
    if took_over:
        s = pt.shortcuts[family]
        return f"shortcut {s['rule']} {s['reference_count']:.2f} -> {s['policy_count']:.2f} per answer"
    return f"overlap lost ({pt.reason.get(family, '?')}) while its reward rose"
