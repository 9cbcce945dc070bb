"""Certification: the true quality of a policy per prompt family, estimated off-policy from the small
expert set (labelled samples of the reference policy), with intervals, and refused where the
evidence cannot carry a number.

Per family, with n expert rows (x_i, y_i, label_i) drawn from the reference:
  - exact sequence importance weights w_i = pi(y_i|x_i) / pi_ref(y_i|x_i);
  - SNIPS, Kish ESS, the largest weight's share and the PSIS tail shape k-hat;
  - a direct estimate: the reward model (with the diagnostic's correction, when given) calibrated
    to the expert labels by least squares, averaged over the policy's own samples on the same
    prompts;
  - the doubly-robust estimate: direct + importance-weighted calibration residuals. This is the
    certified number; its 90% interval is a seeded bootstrap over the expert rows (prompts, labels
    and calibration refit together), paired with the reference's mean for the gain's interval, and
    widened about the estimate by sqrt(1 + 30 / min(ESS, population ESS)) (a finite-sample
    correction: see ope_math.small_sample_widening).
A family is certifiable only when ESS >= min_ess and k-hat <= max_khat on the expert rows, and the
population ESS (n / E_pi[w], from the policy's own samples: it sees mass the expert rows never
reached) is >= min_ess too; otherwise its estimate,
interval and gain are null and `reason` says why. `balanced` is the equal-weight family mix
(deployment traffic), `pilot` the mix of a given prompt file; each is certifiable only if every
family in it is.

    python -m rlhf_mlflow.certify --policy D --reference D --gold F --out F [--rm-dir D]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.config import check_range, check_seed
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.decisions import labelled as L
from rlhf_mlflow.decisions import ope_math as O
from rlhf_mlflow.decisions import sequential as S
from rlhf_mlflow.decisions.mixes import aggregate  # noqa: F401 (certify's API)
from rlhf_mlflow.decisions.overlap import support
from rlhf_mlflow.decisions.policy_labels import (expert_evidence, label_arrays, label_rule, predictor_arrays,  # noqa: F401
                                                 with_labels)


ESTIMATOR_VERSION = 7
"""Which estimator wrote a report (release recomputes it): 1 the bare bootstrap, 2 the ESS widening
(issue 19), 3 PPI's variance over prompts and its widening (issue 17), 4 the labelled interval's skew
correction and the ESS widening's k 20 -> 30, 5 the mixes' allowance for correlated family errors,
6 policy labels joined with the expert set where it vouches, and the sequential rule (issue 31),
7 the labelled predictor's label head, cross-fitted by prompt (cross_fit.py). A report without it was written by 1 or 2."""


@dataclass(frozen=True)
class CertifyConfig:
    min_ess: float = 10.0
    """A family with fewer effective expert samples than this is not certifiable."""
    max_khat: float = 0.7
    """A family whose importance weights have a Pareto tail shape above this is not certifiable."""
    samples_per_prompt: int = 8
    """Policy samples per expert prompt for the direct estimate, KL and shortcut counts."""
    n_boot: int = 2000
    """Bootstrap resamples of the expert rows."""
    level: float = 0.90
    """Two-sided interval level."""
    temperature: float = 1.0
    """Sampling temperature at which the policy is deployed (and the expert set was drawn)."""
    seed: int = 0
    """Seed of the policy samples and the bootstrap."""
    min_labels: int = L.MIN_LABELS
    """A family with at least this many expert labels on the policy's own samples is certified from them."""
    label_looks: int = 1
    """How many times labels bought in rounds are looked at: every interval is union-bounded over them
    (ignored when label_sequential > 0)."""
    label_spending: str = ""
    """Shares of the error budget (1 - level) spent at each look of labels bought in rounds, fixed before
    the first ("0.7,0.1,0.1,0.1": most of it at the first look, where `main` mostly stops), adding up to
    at most 1: look k's interval is at level 1 - share_k (1 - level), and all looks hold together by the
    union bound whatever the stopping rule (sequential.spending_shares). "": union-bounded over label_looks."""
    label_look: int = 1
    """Which look this certification is (with label_spending): the certify step counts it from the store
    (tracking/label_looks.py), and release counts it again."""
    label_sequential: int = 0
    """> 0: labels are looked at as they come (after every round, any number of rounds) and a labelled
    interval is the anytime-valid confidence sequence tightest at this many labels per family
    (sequential.py); 0: a fixed-level interval (union-bounded over label_looks)."""
    label_combine: bool = True
    """A family the expert set can vouch for is certified from the expert set and its policy labels
    together (combine.py, from labelled.MIN_COMBINED_LABELS labels); False: from the labels alone."""
    label_folds: int = 10
    """Labelled certification's predictor: the reward model with a label head learned from the expert set
    and the policy labels, cross-fitted over this many folds of the family's prompts (cross_fit.py); 0:
    the calibrated reward model alone (estimator 6)."""
    label_widening: float = L.LABEL_WIDENING
    """Labelled (PPI) intervals are widened about the estimate by this factor (labelled.LABEL_WIDENING)."""
    ess_widening: float = 30.0
    """Off-policy intervals are widened about the estimate by sqrt(1 + ess_widening / min(ESS, population
    ESS)): the percentile bootstrap's spread fell 10-20% short of the estimator's at ESS 20-45
    (ope_math.small_sample_widening); 0 keeps the bare bootstrap. 10, then 20, left one bench world
    under 90% family coverage on expert sets the constant was not chosen on (docs/CERTIFICATION.md)."""
    off_policy: bool = True
    """False: the expert set certifies no family, its policy labels alone do. certify sets it when the
    reward model learnt from the expert set (a repaired one, repair.json beside its weights): its
    residuals there are in-sample, so the off-policy and joint estimates would be too sure; on a
    policy's own fresh labels it is a fixed predictor like any other (docs/REPAIR.md)."""
    chosen_on_expert_set: bool = False
    """True: the policy is a checkpoint chosen among its training run's by estimates from this expert set
    (the over-optimisation watch's best point or proposal), so the expert set is no evidence of its value:
    the best of many noisy estimates is biased upwards by the choice (the winner's curse), and the
    off-policy and joint estimates would inherit the bias. Only labels on the policy's own fresh samples
    certify it (the predictor may still learn from the expert set: it is not evidence, and PPI is unbiased
    for any predictor the fresh labels did not choose). certify sets it from the version's training run
    (steps/selection.py), and release checks it again from the store."""
    family_correlation: float = 0.1
    """A mix's interval (balanced, pilot) allows this correlation between its families' errors
    (ope_math.mix_widening): the bootstrap draws each family's rows on their own, as if independent,
    and on one bench world the six families' errors correlated 0.12-0.14 across expert sets (balanced
    coverage 0.85-0.88 while its families covered 0.94-0.98; ~0 on another); 0 treats them as
    independent (docs/CERTIFICATION.md)."""

    def __post_init__(self):
        # upper bounds: far beyond any useful value, short of what would exhaust memory or never end
        check_range("min_ess", self.min_ess, 1, 1e9)
        check_range("max_khat", self.max_khat, 0, 1e3)
        check_range("samples_per_prompt", self.samples_per_prompt, 1, 1024, integer=True)
        check_range("n_boot", self.n_boot, 100, 1_000_000, integer=True)
        check_range("level", self.level, 0, 1, lo_open=True)
        check_range("temperature", self.temperature, 0, 100, lo_open=True)
        check_seed("seed", self.seed)
        check_range("min_labels", self.min_labels, 2, 1_000_000, integer=True)
        check_range("label_looks", self.label_looks, 1, 1000, integer=True)
        check_range("label_sequential", self.label_sequential, 0, 1_000_000, integer=True)
        check_range("label_look", self.label_look, 1, 1000, integer=True)
        shares = S.spending_shares(self.label_spending)
        if shares and self.label_look > len(shares):
            raise InputError(f"label_look {self.label_look}: label_spending {self.label_spending!r} allows "
                             f"{len(shares)} looks")
        check_range("label_folds", self.label_folds, 0, 100, integer=True)
        if self.label_folds == 1:
            raise InputError("label_folds must be 0 (the reward model alone) or >= 2 (cross-fitted), got 1")
        check_range("ess_widening", self.ess_widening, 0, 1e6)
        check_range("label_widening", self.label_widening, 1, 100)
        check_range("family_correlation", self.family_correlation, 0, 1)


def bootstrap_rows(rng: np.random.Generator, n: int, n_boot: int) -> np.ndarray:
    """The expert rows of each bootstrap resample, (n_boot, n) indices into a family's n rows."""
    return rng.integers(0, n, size=(n_boot, n))


def estimate_family(ev: dict, cfg: CertifyConfig, idx: np.ndarray) -> tuple[dict, np.ndarray, np.ndarray]:
    """One family's report row, plus its bootstrap draws of (estimate, reference mean) over the
    resamples `idx` of its expert rows (bootstrap_rows). Without log-ratios (a table that gave the
    policy's log-probs of no expert row) the expert set is no evidence about the policy: the row is
    refused, saying so (`ev["why_not"]`), and only labels can certify it."""
    if "log_ratios" not in ev:
        return _without_off_policy(ev, idx)
    lw, y = ev["log_ratios"], ev["labels"]
    n = len(y)
    row = {"n": n, "reference": float(y.mean()), "snips": O.snips(lw, y), "ess": O.kish_ess(lw),
           "pop_ess": ev["pop_ess"], "max_weight_share": O.max_weight_share(lw), "khat": O.pareto_khat(lw),
           "kl": ev["kl"],
           "shortcuts": ev["shortcuts"]}
    ref_draws = y[idx].mean(1)
    p = _boot_weights(lw, idx)                                          # (B, n) normalised
    if "scores" in ev:
        s, ps = ev["scores"], ev["policy_scores"]
        a, b = O.linear_calibration(s, y)
        row["direct"] = a + b * float(ps.mean())
        row["calibration"] = {"intercept": a, "slope": b, "r": float(np.corrcoef(s, y)[0, 1]) if s.std() > 0 else 0.0}
        row["doubly_robust"] = O.doubly_robust(lw, y, a + b * s, row["direct"])
        row["method"] = "doubly_robust"
        point = row["doubly_robust"]
        ab, bb, direct_draws = O.calibration_draws(s, y, ps, idx)
        draws = direct_draws + (p * (y[idx] - ab[:, None] - bb[:, None] * s[idx])).sum(1)
    else:
        row["method"] = "snips"
        point = row["snips"]
        draws = (p * y[idx]).sum(1)
        if "calibration" in ev:  # a table's scores, calibrated on the expert set: labels' predictor
            row["calibration"] = ev["calibration"]
    row.update(support(row["ess"], row["khat"], row["pop_ess"], n, cfg))
    if not cfg.off_policy and row["certifiable"]:
        row.update(certifiable=False, reason=IN_SAMPLE)
    elif cfg.chosen_on_expert_set and row["certifiable"]:
        row.update(certifiable=False, reason=CHOSEN_ON)
    row["widening"] = O.small_sample_widening(min(row["ess"], row["pop_ess"]), cfg.ess_widening)
    draws = point + row["widening"] * (draws - point)
    lo_q, hi_q = (1 - cfg.level) / 2, (1 + cfg.level) / 2
    if row["certifiable"]:
        row.update(estimate=point, lo=float(np.quantile(draws, lo_q)), hi=float(np.quantile(draws, hi_q)),
                   gain=point - row["reference"], gain_lo=float(np.quantile(draws - ref_draws, lo_q)),
                   gain_hi=float(np.quantile(draws - ref_draws, hi_q)))
    else:
        row.update(estimate=None, lo=None, hi=None, gain=None, gain_lo=None, gain_hi=None)
    return row, draws, ref_draws


def _without_off_policy(ev: dict, idx: np.ndarray) -> tuple[dict, np.ndarray, np.ndarray]:
    y = np.asarray(ev["labels"], float)
    ref_draws = y[idx].mean(1) if len(y) else np.zeros(len(idx))
    row = {"n": len(y), "reference": float(y.mean()) if len(y) else None, "ess": None, "pop_ess": None,
           "khat": None, "kl": ev.get("kl"), "shortcuts": ev["shortcuts"], "method": None,
           "certifiable": False, "reason": ev["why_not"], "estimate": None, "lo": None, "hi": None, "gain": None,
           "gain_lo": None, "gain_hi": None}
    if "calibration" in ev:
        row["calibration"] = ev["calibration"]
    return row, ref_draws.copy(), ref_draws


def _boot_weights(lw: np.ndarray, idx: np.ndarray) -> np.ndarray:
    lwb = lw[idx]
    w = np.exp(lwb - lwb.max(1, keepdims=True))
    return w / w.sum(1, keepdims=True)


def estimate_families(evidence: dict[str, dict], labelled: dict[str, list[dict]],
                      label_scores: dict[str, np.ndarray | None], cfg: CertifyConfig) -> tuple[dict, dict, dict]:
    """Every family's row and bootstrap draws from its evidence (family_evidence, or a table's:
    table_evidence.py), certified from the policy labels where `labelled` has them (`label_scores`: the
    corrected reward model's scores of those labelled responses, None without a reward model): what
    certify reports, from arrays, without sampling anything again."""
    rng = np.random.default_rng(cfg.seed)
    rows, draws, ref_draws = {}, {}, {}
    for f, ev in evidence.items():
        idx = bootstrap_rows(rng, len(ev["labels"]), cfg.n_boot) if len(ev["labels"]) else np.zeros((cfg.n_boot, 0), int)
        rows[f], draws[f], ref_draws[f] = estimate_family(ev, cfg, idx)
        if f in labelled:  # a stream of its own: labels on one family leave every other family's numbers as they were
            label_rng = np.random.default_rng([cfg.seed, 1 + V.FAMILIES.index(f)])
            rows[f], ppi_draws = with_labels(rows[f], ev, labelled[f], label_scores.get(f), cfg, label_rng)
            draws[f] = draws[f] if ppi_draws is None else ppi_draws
    return rows, draws, ref_draws


IN_SAMPLE = "the reward model learnt from the expert set: certified from policy labels only"
CHOSEN_ON = ("the checkpoint was chosen on this expert set's estimates (the watch): its number there is biased "
             "upwards by the choice; certified from labels on its own samples only")
