"""Certification from expert labels on the policy's own samples: prediction-powered inference (PPI++,
Angelopoulos et al. 2023) with the calibrated reward model as the predictor.

For one family, with the predictor f (the corrected reward model calibrated to the expert set),
unlabelled samples of the policy on P prompts (f_u, one row per prompt) and n labelled ones (f_l,
labels y):

    theta = lam * mean(f_u) + mean(y - lam * f_l)

is unbiased for the policy's mean true quality for any fixed lam (the labels remove the predictor's
bias). The estimand is the family's prompt distribution, not the P prompts the samples were drawn on,
so the variance is taken over prompts: var(per-prompt mean of lam f_u) / P + var(y - lam f_l) / n,
plus twice the two terms' covariance where the labels were drawn on those same prompts (as
label_requests draws them). Counting the P x m unlabelled samples as independent left the prompts'
own spread out: the intervals covered the expert prompts' truth and missed the deployment truth.
lam = cov(y, f_l) / (var(f) + n var_u) (clipped to [0, 1]) is the variance-minimising weight without
the shared-prompt term; the interval shrinks with how well the reward model predicts the labels. It
uses Student's t with n - 1 degrees of freedom, moved by Hall's (1992) Edgeworth correction for the
estimate's skewness (skew_shift): fraction-of-8 labels near 0 or 1 are skewed, and a symmetric interval
around a skewed mean misses on one side more than the other, most at few labels. The gain over the
reference pairs each prompt's unlabelled mean with the reference's expert label on that prompt
(a - y_ref in place of a above).

Labels requested in rounds are looked at after every round: a union bound over the `looks` allowed
keeps every look's interval valid together (each at level 1 - (1 - level) / looks); or a spending rule
fixed before the first look gives look k its own share s_k of the error budget (sum s_k <= 1, so the
looks hold together by the same union bound, whatever the stopping rule: a weighted Bonferroni), most
of it where the caller mostly stops (sequential.spending_shares; the look is counted from the store,
tracking/label_looks.py, not claimed); or, with
`sequential` > 0, the anytime-valid confidence sequence of sequential.py holds at every look at once,
however many. Where the expert set can vouch for the family too, the labels join its off-policy evidence
in one estimate (combine.py; with_policy_labels).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

from rlhf_mlflow.decisions import combine as CB
from rlhf_mlflow.decisions import sequential as S

LABEL_WIDENING = 1.15
"""The labelled interval's half-width is multiplied by this. Over 4,500 labelled family intervals (six
bench worlds, 6 expert sets x 3 independent label draws, K = 50) the errors' spread was 1.02-1.14x
the t interval's standard error per world, misses lying low more often than high (fraction-of-8
labels are skewed where quality sits near 0): coverage 0.872-0.897 at 90%. x1.15 measured 0.914-0.943
family and 0.897-0.960 balanced. An empirical constant like ope_math's ESS widening, not a theorem."""

MIN_LABELS = 20
"""A family is certifiable from policy labels alone with at least this many: below it the t interval
of a fraction-of-8 quality is too rough to decide a 0.03 guardrail, and the tuned weight too noisy."""


MIN_COMBINED_LABELS = 10
"""A family the expert set can vouch for takes policy labels into one joint estimate from this many (combine.py)."""


@dataclass(frozen=True)
class PPI:
    estimate: float
    se: float
    lam: float
    """The predictor's weight (0: the labels' own mean; 1: plain PPI)."""
    n: int
    """Labels."""
    N: int
    """Unlabelled policy samples."""
    prompt_means: np.ndarray
    """The predictor's mean per unlabelled prompt (what the gain pairs with the reference's labels)."""
    residuals: np.ndarray
    """y - lam * f_l per label."""
    label_prompts: np.ndarray
    """Per label, the row of f_u whose prompt it was drawn on (-1: a prompt of its own)."""

    @property
    def residual_var(self) -> float:
        return float(np.var(self.residuals, ddof=1))


def _per_prompt(f_unlabelled) -> list[np.ndarray]:
    """The predictions on each unlabelled prompt: rows of a (P, m) array (a 1-D array is one sample per
    prompt), or a list of P arrays of any lengths (a table's prompts need not have equal samples)."""
    if isinstance(f_unlabelled, list):
        return [np.asarray(a, dtype=float).ravel() for a in f_unlabelled]
    fu = np.asarray(f_unlabelled, dtype=float)
    return list(fu[:, None] if fu.ndim == 1 else fu.reshape(len(fu), -1))


def ppi_mean(f_unlabelled: np.ndarray, f_labelled: np.ndarray, labels: np.ndarray,
             label_prompts: np.ndarray | None = None) -> PPI:
    """The PPI++ estimate of E[y] under the policy, with its standard error; `f_unlabelled` is (P, m),
    m samples on each of P prompts (1-D: one per prompt; a list: P arrays of their own lengths), its
    estimand the mean over prompts; `label_prompts` says on which of those prompts each label was drawn
    (-1 or None: prompts of their own)."""
    fu = _per_prompt(f_unlabelled)
    fl, y = (np.asarray(a, dtype=float) for a in (f_labelled, labels))
    n, P = len(y), len(fu)
    if P == 0 or any(len(a) == 0 for a in fu):
        raise ValueError("PPI needs at least one unlabelled sample on every unlabelled prompt")
    if n < 2:
        raise ValueError(f"PPI needs at least 2 labels, got {n}")
    at = np.full(n, -1) if label_prompts is None else np.asarray(label_prompts, dtype=int)
    if len(at) != n or at.max(initial=-1) >= P:
        raise ValueError(f"label_prompts must give one row of f_unlabelled (< {P}) or -1 per label")
    means = np.array([a.mean() for a in fu])
    flat = np.concatenate(fu)
    var_u = float(np.var(means, ddof=1)) / P if P > 1 else 0.0
    var_f = np.var(np.concatenate([flat, fl]), ddof=1)
    cov = np.cov(y, fl, ddof=1)[0, 1]
    lam = 0.0 if var_f <= 1e-12 else float(np.clip(cov / (var_f + n * var_u), 0.0, 1.0))
    est = PPI(float(lam * means.mean() + (y - lam * fl).mean()), 0.0, lam, n, len(flat), means, y - lam * fl, at)
    return replace(est, se=float(np.sqrt(_variance(est, lam * means))))


def _variance(est: PPI, a: np.ndarray) -> float:
    """Var(mean over prompts of a + mean of the residuals), a one value per unlabelled prompt: the two
    terms share the prompts the labels were drawn on, and cov(mean_P a, mean_n r) = n_shared / (P n)
    * cov(a_p, r) over them."""
    P, n = len(a), est.n
    v = (float(np.var(a, ddof=1)) / P if P > 1 else 0.0) + est.residual_var / n
    shared = est.label_prompts >= 0
    if shared.sum() >= 2:
        v += 2 * shared.sum() / (P * n) * float(np.cov(a[est.label_prompts[shared]], est.residuals[shared], ddof=1)[0, 1])
    return max(v, est.residual_var / n / 4)   # a floor: the shared-prompt covariance is estimated too


def paired_gain_terms(est: PPI, reference_labels: np.ndarray, paired: bool = True) -> np.ndarray | None:
    """Per unlabelled prompt, lam * its predictor mean - the reference's label on it, when the
    reference's labels are on those prompts (one each, in order: `paired`); else None."""
    ref = np.asarray(reference_labels, dtype=float)
    if paired and len(ref) == len(est.prompt_means) and len(ref) > 1:
        return est.lam * est.prompt_means - ref
    return None


def gain_se(est: PPI, reference_labels: np.ndarray, paired: bool = True) -> float:
    """The standard error of estimate - mean(reference_labels): paired per prompt when the reference's
    labels are on the unlabelled samples' prompts (paired_gain_terms), else as independent."""
    terms = paired_gain_terms(est, reference_labels, paired)
    if terms is not None:
        return float(np.sqrt(_variance(est, terms)))
    ref = np.asarray(reference_labels, dtype=float)
    return float(np.sqrt(est.se ** 2 + np.var(ref, ddof=1) / len(ref)))


def _third_cumulant(x: np.ndarray) -> float:
    """The unbiased estimate (k-statistic) of a sample's third cumulant."""
    n = len(x)
    if n < 3:
        return 0.0
    return float(n * np.sum((x - x.mean()) ** 3) / ((n - 1) * (n - 2)))


MAX_SKEW = 0.5
"""The estimate's skewness used by skew_shift is clipped to +-this (a shift of at most 0.53 SE at 90%):
a third moment from 20-50 labels is itself rough."""


def skew_shift(est: PPI, a: np.ndarray, se: float, level: float, looks: float = 1) -> float:
    """How far the studentised interval of `est` (with unlabelled per-prompt terms `a`, the mean of a
    plus the mean of the residuals, standard error `se`) moves for the estimate's skewness: Hall (1992,
    sec. 3.5), the quantiles of (theta_hat - theta) / se are z_p - g (2 z_p^2 + 1) / 6 to order 1/sqrt(n),
    with g the estimate's skewness, here k3(a) / P^2 + k3(residuals) / n^2 over se^3 (cross terms left
    out). Right-skewed labels (quality near 0) move the interval up."""
    if se <= 0:
        return 0.0
    g = (_third_cumulant(np.asarray(a, float)) / len(a) ** 2 + _third_cumulant(est.residuals) / est.n ** 2) / se ** 3
    z = NormalDist().inv_cdf(1.0 - (1.0 - level) / max(looks, 1) / 2.0)
    return float(se * np.clip(g, -MAX_SKEW, MAX_SKEW) * (2 * z * z + 1) / 6)


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile by the Cornish-Fisher expansion around the normal one (Abramowitz & Stegun
    26.7.5): within 1e-3 of the exact value for df >= 10, conservative-side rough below."""
    z = NormalDist().inv_cdf(p)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def half_width(se: float, n: int, level: float, looks: float = 1, sequential: int = 0) -> float:
    """Half the width of the two-sided interval at `level`: Student's t, union-bounded over `looks`; or,
    with `sequential` > 0, the anytime-valid confidence sequence tightest at that many labels
    (sequential.py), valid at whichever look the caller stops."""
    if sequential > 0:
        return float(S.multiplier(n, level, sequential) * se)
    alpha = (1.0 - level) / max(looks, 1)
    return float(t_quantile(1.0 - alpha / 2.0, max(n - 1, 1)) * se)


def interval_draws(estimate: float, hw: float, level: float, size: int, rng: np.random.Generator,
                   shift: float = 0.0) -> np.ndarray:
    """Normal draws whose central `level` interval is estimate + shift +- hw (its union-bounded or
    sequential, widened, skew-corrected interval): how a labelled family enters a bootstrapped aggregate
    beside off-policy families."""
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    return estimate + shift + rng.standard_normal(size) * hw / z


def influence_skew_shift(c: np.ndarray, se: float, level: float) -> float:
    """skew_shift for a mean of P per-prompt influence terms c (combine.py): g = k3(c) / P^2 / se^3."""
    if se <= 0:
        return 0.0
    g = _third_cumulant(np.asarray(c, float)) / len(c) ** 2 / se ** 3
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    return float(se * np.clip(g, -MAX_SKEW, MAX_SKEW) * (2 * z * z + 1) / 6)


@dataclass(frozen=True)
class Rule:
    """How a labelled family's interval is drawn (CertifyConfig's label_* fields)."""
    level: float
    looks: float = 1
    """Looks the error budget is split over (a spending rule's look: 1 / its share)."""
    sequential: int = 0
    widening: float = 1.0
    min_labels: int = MIN_LABELS
    paired: bool = True
    """The reference's labels are on the unlabelled samples' prompts, one each, in order (certify's
    expert set; a table's only where its prompts are the expert set's)."""


def with_policy_labels(row: dict, f_unlabelled: np.ndarray, f_labelled: np.ndarray, labels: np.ndarray,
                       reference_labels: np.ndarray, rule: Rule, n_boot: int, rng: np.random.Generator,
                       label_prompts: np.ndarray | None = None, expert: dict | None = None
                       ) -> tuple[dict, np.ndarray | None]:
    """A family's certify row redone with policy labels, and normal draws for the aggregates. With
    `expert` (the off-policy evidence, given only where the expert set can vouch: its labels,
    calibrated predictions, log-ratios and widening) and >= MIN_COMBINED_LABELS labels, one estimate
    from both (combine.py); else, with >= rule.min_labels labels, PPI on the labels alone; else the
    off-policy row stands and says how many labels it has (draws None). The off-policy row is kept
    under `off_policy`; `evidence_weights` says what certified the family and with what weight."""
    n = len(labels)
    off = {k: row.get(k) for k in ("certifiable", "reason", "estimate", "lo", "hi", "gain", "gain_lo", "gain_hi",
                                   "method")}
    out = {**row, "labels": n, "off_policy": off}
    at = None if label_prompts is None else np.asarray(label_prompts, dtype=int)
    joint = expert is not None and n >= MIN_COMBINED_LABELS and at is not None and bool((at >= 0).all())
    if n < rule.min_labels and not joint:
        out["reason"] = f"{row['reason']}; {n} policy labels < {rule.min_labels} needed to certify from labels"
        out["evidence"] = "expert set (off-policy)" if row["certifiable"] else "none"
        out["evidence_weights"] = {"expert_set": 1.0} if row["certifiable"] else {}
        return out, None
    est = ppi_mean(f_unlabelled, f_labelled, labels, label_prompts)
    if joint:
        return _joint_row(out, est, expert, reference_labels, rule, n_boot, rng)
    look = 1 if rule.sequential else rule.looks          # the skew correction is a one-look expansion
    hw = rule.widening * half_width(est.se, n, rule.level, rule.looks, rule.sequential)
    shift = skew_shift(est, est.lam * est.prompt_means, est.se, rule.level, look)
    g_se, terms = gain_se(est, reference_labels, rule.paired), paired_gain_terms(est, reference_labels, rule.paired)
    g_shift = skew_shift(est, est.lam * est.prompt_means if terms is None else terms, g_se, rule.level, look)
    gain_hw = rule.widening * half_width(g_se, n, rule.level, rule.looks, rule.sequential)
    gain = est.estimate - row["reference"]
    out.update(certifiable=True, reason="ok", method="ppi", evidence=f"policy labels ({n})",
               evidence_weights={"policy_labels": 1.0}, estimate=est.estimate,
               lo=est.estimate + shift - hw, hi=est.estimate + shift + hw, gain=gain,
               gain_lo=gain + g_shift - gain_hw, gain_hi=gain + g_shift + gain_hw,
               ppi={"lambda": est.lam, "se": est.se, "unlabelled": est.N, "looks": rule.looks,
                    "sequential": rule.sequential, "widening": rule.widening, "skew_shift": shift})
    return out, interval_draws(est.estimate, hw, rule.level, n_boot, rng, shift)


def _joint_row(out: dict, est: PPI, expert: dict, reference_labels: np.ndarray, rule: Rule, n_boot: int,
               rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """The row certified from the expert set and the policy labels together (combine.py)."""
    n = est.n
    c = CB.combine(est.lam * est.prompt_means, est.residuals, est.label_prompts,
                   expert["labels"] - est.lam * expert["predictions"], expert["log_ratios"], expert["widening"])
    hw = rule.widening * half_width(c.se, n, rule.level, rule.looks, rule.sequential)
    shift = influence_skew_shift(c.influence, c.se, rule.level)
    gain_terms = c.influence - np.asarray(reference_labels, float)     # paired per expert prompt
    g_se = float(np.sqrt(np.var(gain_terms, ddof=1) / len(gain_terms)))
    g_shift = influence_skew_shift(gain_terms, g_se, rule.level)
    gain_hw = rule.widening * half_width(g_se, n, rule.level, rule.looks, rule.sequential)
    gain = c.estimate - out["reference"]
    out.update(certifiable=True, reason="ok", method="ppi+dr",
               evidence=f"expert set + policy labels ({n}), labels' weight {c.alpha:.2f}",
               evidence_weights={"expert_set": 1.0 - c.alpha, "policy_labels": c.alpha}, estimate=c.estimate,
               lo=c.estimate + shift - hw, hi=c.estimate + shift + hw, gain=gain,
               gain_lo=gain + g_shift - gain_hw, gain_hi=gain + g_shift + gain_hw,
               ppi={"lambda": est.lam, "se": c.se, "alpha": c.alpha, "unlabelled": est.N, "looks": rule.looks,
                    "sequential": rule.sequential, "widening": rule.widening, "skew_shift": shift})
    return out, interval_draws(c.estimate, hw, rule.level, n_boot, rng, shift)
