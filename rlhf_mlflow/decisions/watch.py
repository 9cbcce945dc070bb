"""The over-optimisation watch: during training, each family's true quality estimated from the expert
set (certify's estimator, not a copy), the Gao-form fit of its gain against sqrt(KL), and the rule that
says a family is past its peak.

Every `watch_every` steps (and every `watch_early_every` before the first: RLConfig.watch_due), per
family with expert rows:
  - certify.families_evidence + estimate_family on the current policy: the calibrated, corrected reward
    model on the policy's own samples plus the importance-weighted calibration residuals (doubly
    robust) where the overlap rule allows, else the direct estimate alone, held above the family's
    lowest expert label; its standard error is the bootstrap's sd over the expert rows. Every
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
import torch

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.config import check_range
from rlhf_mlflow.decisions import certify as C
from rlhf_mlflow.decisions import ope_math as O


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


MIN_KL = 1e-5
"""A KL estimate below this is float32 rounding of the sequence log-probs, not a policy that moved (the
reference against itself reads 0 to 3e-7 nats): such points carry no d for the fit."""


FORMS = {"rl": (lambda d: -d * np.log(d), lambda alpha, beta: math.exp(min(alpha / beta - 1, 50.0))),
         "bon": (lambda d: -d * d, lambda alpha, beta: alpha / (2 * beta))}
"""Gao et al.'s two forms, gain = alpha d + beta * second(d): RL's d (alpha - beta log d), peak
exp(alpha/beta - 1); best-of-n's d (alpha - beta d), peak alpha / (2 beta). Each: (second, peak_d)."""


def gao_fit(d, gain, se, form: str = "rl") -> dict:
    """Weighted least squares (weights 1/se^2) of the `form`'s gain (FORMS) over the points with
    d^2 >= MIN_KL; its peak_d and peak_kl = peak_d^2 when beta > 0 (else None: no peak in the
    fitted form)."""
    second, peak_of = FORMS[form]
    d, gain, se = (np.asarray(x, float) for x in (d, gain, se))
    keep = d * d >= MIN_KL
    d, gain, w = d[keep], gain[keep], 1.0 / np.maximum(se[keep], 1e-6)  # sqrt of the weights 1/se^2
    if len(d) < 2:
        return {"form": form, "alpha": None, "beta": None, "peak_d": None, "peak_kl": None}
    X = np.stack([d, second(d)], 1)                                     # (n, 2)
    (alpha, beta), *_ = np.linalg.lstsq(X * w[:, None], gain * w, rcond=None)
    peak = peak_of(alpha, beta) if beta > 0 else None
    return {"form": form, "alpha": float(alpha), "beta": float(beta), "peak_d": peak,
            "peak_kl": None if peak is None else peak * peak}


def point_fits(points: list["WatchPoint"], families, form: str = "rl") -> dict[str, dict]:
    """Each family's `form` fit (gao_fit) of its gain against d = sqrt(KL) over these points."""
    return {f: gao_fit([math.sqrt(p.kl[f]) for p in points], [p.gain[f] for p in points],
                       [p.se[f] for p in points], form) for f in families}


def fit_metrics(fits: dict[str, dict]) -> dict[str, float]:
    """The fits' metric names (without a prefix): gao_alpha/<family>, gao_beta/..., gao_peak_kl/...,
    for the fits that have them."""
    return {f"gao_{k}/{f}": fit[k] for f, fit in fits.items() for k in ("alpha", "beta", "peak_kl")
            if fit[k] is not None}


def gao_curve(fit: dict, d) -> np.ndarray:
    """The fitted gain at these d (0 at d = 0)."""
    d = np.asarray(d, float)
    safe = np.where(d > 0, d, 1.0)
    return np.where(d > 0, fit["alpha"] * d + fit["beta"] * FORMS[fit.get("form", "rl")][0](safe), 0.0)


def direct_estimate(scores: np.ndarray, labels: np.ndarray, policy_scores: np.ndarray,
                    idx: np.ndarray) -> tuple[float, np.ndarray]:
    """The direct estimate alone (no importance-weighted term) and its bootstrap draws over the
    expert rows `idx`: the expert rows' linear calibration applied to the policy's scores (per expert
    prompt), held above the family's lowest label (a correction subtracts a premium per shortcut
    occurrence, which on a policy that repeats the shortcut takes the calibrated line below any label)."""
    lo = float(labels.min())
    a, b = O.linear_calibration(scores, labels)
    draws = np.maximum(O.calibration_draws(scores, labels, policy_scores, idx)[2], lo)
    return max(a + b * float(policy_scores.mean()), lo), draws


def with_balanced(pt: "WatchPoint", fams: list[str]) -> "WatchPoint":
    """The point's `balanced` entries (the equal-weight mix of these families) and every se."""
    pt.estimate["balanced"] = float(np.mean([pt.estimate[f] for f in fams]))
    pt.draws["balanced"] = np.mean([pt.draws[f] for f in fams], 0)
    pt.kl["balanced"] = float(np.mean([pt.kl[f] for f in fams]))
    pt.gain["balanced"] = float(np.mean([pt.gain[f] for f in fams]))
    pt.se = {k: float(np.std(v)) for k, v in pt.draws.items()}
    return pt


def shortcut_rises(counted: list[dict]) -> dict | None:
    """The shortcut among one family's counts (certify.family_evidence's `shortcuts`) whose count per
    answer rose most over the reference's, with the rise and its se; None without shortcuts."""
    if not counted:
        return None
    top = max(counted, key=lambda s: s["policy_count"] - s["reference_count"])
    return {"rule": SR.describe(top), "policy_count": top["policy_count"], "reference_count": top["reference_count"],
            "rise": top["policy_count"] - top["reference_count"], "se": top["policy_count_se"]}


def shortcut_alarm(pt: WatchPoint, family: str, cfg: WatchConfig) -> bool:
    """Whether a flagged shortcut took over at this point: its count per answer above the reference's by
    more than max_shortcut_rise and by more than z standard errors."""
    s = pt.shortcuts.get(family)
    return s is not None and s["rise"] > cfg.max_shortcut_rise and s["rise"] > cfg.z * s["se"]


def below_best(points: list[WatchPoint], family: str, cfg: WatchConfig) -> bool:
    """Whether the last point's estimate is below the best earlier one by more than z combined ses
    (sqrt(se_best^2 + se_last^2)) and by at least min_drop."""
    last, earlier = points[-1], points[:-1]
    if not earlier:
        return False
    best = max(earlier, key=lambda p: p.estimate[family])
    drop = best.estimate[family] - last.estimate[family]
    return drop >= cfg.min_drop and drop > cfg.z * math.hypot(best.se[family], last.se[family])


class Watch:
    """Estimates at each call, remembers the points, says which families passed their peak."""

    def __init__(self, reference, rm, wrapper, gold: list[dict], cfg: WatchConfig = WatchConfig(),
                 shortcuts: list[dict] = ()):
        """`shortcuts`: the flagged shortcut rules to count (default: the wrapper's RULES, if any)."""
        self.reference, self.rm, self.wrapper, self.cfg = reference, rm, wrapper, cfg
        by_family = D.group_by_family(gold)
        self.families = {f: by_family[f] for f in V.FAMILIES if f in by_family}
        shortcuts = list(shortcuts or getattr(wrapper, "rules", ()))
        ref_cfg = C.CertifyConfig(samples_per_prompt=cfg.reference_samples)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.fixed = {f: C.fixed_evidence(reference, rm, wrapper, rows, shortcuts, ref_cfg, gen)
                      for f, rows in self.families.items()}
        self.why: dict[str, str] = {}
        """Per fired family, which rule fired: `estimate fell` or `shortcut <rule> <ref> -> <count> per answer`."""
        self.ccfg = C.CertifyConfig(samples_per_prompt=cfg.samples_per_prompt, n_boot=cfg.n_boot, seed=cfg.seed)
        self.points: list[WatchPoint] = []
        self.fired: dict[str, int] = {}
        self._streak = dict.fromkeys(self.families, 0)

    @torch.no_grad()
    def estimate(self, step: int, policy) -> WatchPoint:
        """Every family's estimate of the policy's true quality (no state changed)."""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        pt = WatchPoint(step, {}, {}, {}, {}, {}, {})
        evidence = C.families_evidence(policy, self.reference, self.rm, self.wrapper, self.families, self.ccfg,
                                       gen, self.fixed)
        for i, (f, rows) in enumerate(self.families.items()):
            ev = evidence[f]
            idx = C.bootstrap_rows(np.random.default_rng(self.cfg.seed + i), len(rows), self.cfg.n_boot)
            row, draws, _ = C.estimate_family(ev, self.ccfg, idx)
            if row["certifiable"]:
                pt.estimate[f], pt.method[f] = row["estimate"], "doubly_robust"
            else:  # the same bootstrap rows, without the importance-weighted term
                pt.estimate[f], draws = direct_estimate(ev["scores"], ev["labels"], ev["policy_scores"], idx)
                pt.method[f] = "direct"
            pt.draws[f], pt.kl[f] = draws, max(row["kl"], 0.0)
            if (rise := shortcut_rises(ev["shortcuts"])) is not None:
                pt.shortcuts[f] = rise
            pt.gain[f] = pt.estimate[f] - row["reference"]
        return with_balanced(pt, list(self.families))

    def observe(self, step: int, policy) -> WatchPoint:
        """Estimate, remember, and mark the families that pass their peak at this point."""
        return self.add(self.estimate(step, policy))

    def add(self, pt: WatchPoint) -> WatchPoint:
        """Remember a point (estimated here, or given: a test's synthetic sequence) and apply the rule."""
        self.points.append(pt)
        for f in self.families:
            self._streak[f] = self._streak[f] + 1 if below_best(self.points, f, self.cfg) else 0
            fell, took_over = self._streak[f] >= self.cfg.confirm, shortcut_alarm(pt, f, self.cfg)
            if (fell or took_over) and f not in self.fired:
                self.fired[f] = pt.step
                s = pt.shortcuts.get(f)
                self.why[f] = "estimate fell" if fell else \
                    f"shortcut {s['rule']} {s['reference_count']:.2f} -> {s['policy_count']:.2f} per answer"
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
        """A point's names under watch/ (without the prefix): estimates, ses, fits, past-peak flags."""
        out = {**pt.estimate, **{f"se/{k}": v for k, v in pt.se.items()}, **fit_metrics(self.fits()),
               **{f"past_peak/{f}": float(f in self.fired) for f in self.families}}
        out.update({f"shortcut_rise/{f}": s["rise"] for f, s in pt.shortcuts.items()})
        return out

    def best_step(self) -> int | None:
        """The step of the trained point (step > 0: the reference is what training is measured
        against, not a candidate) with the best balanced estimate; the first such; None before a
        trained point. Whether the expert set alone could certify it is not asked: `main` buys labels
        on the policy's own samples where it cannot (preferring the points that overlap allowed picked
        step 30 of corrected-kl005-s1200 once the watch looked every 10 steps early on, truth 0.40
        against 0.53 at its best point)."""
        return best_step(self.points)


def best_step(points: list[WatchPoint]) -> int | None:
    """Watch.best_step of these points (a benchmark asks it of the points before an alarm)."""
    trained = [p for p in points if p.step > 0]
    return max(trained, key=lambda p: p.estimate["balanced"]).step if trained else None
