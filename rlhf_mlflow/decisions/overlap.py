"""Overlap: can the expert set, drawn from the reference, carry an estimate for this policy?

The importance weights w = pi(y|x) / pi_ref(y|x) of the expert rows must not be degenerate (Kish ESS,
the PSIS tail shape k-hat), and the population ESS n / E_pi[w], computed from the policy's OWN samples,
must be large enough too: the rows cannot show mass the policy puts where they never went. `support`
is the one place the refusal rule lives; `weight_support` applies it without reading a label (how
`main` chooses a checkpoint without biasing its certified number).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions import ope_math as O


def own_samples(policy, reference, prompts, cfg, gen: torch.Generator, with_reference: bool = True):
    """K samples per prompt from the policy and from the reference (in that order on `gen`: certify
    and weight_support draw the same ones; None for the reference's without `with_reference`), and
    the log-ratios of the policy's own samples."""
    K = cfg.samples_per_prompt
    own_lp: list = []  # at temperature 1 the sampler's log-probs are the policy's: one forward pass saved
    own = rollout.sample(policy, prompts, K, cfg.temperature, gen, own_lp if cfg.temperature == 1.0 else None)
    ref_own = rollout.sample(reference, prompts, K, cfg.temperature, gen) if with_reference else None
    prompts_rep = prompts.repeat_interleave(K, 0)
    if not own_lp:
        return own, ref_own, log_ratios(policy, reference, prompts_rep, own)
    return own, ref_own, (own_lp[0] - M.sequence_logprobs(reference, prompts_rep, own)).double().numpy()


def log_ratios(policy, reference, prompts, responses) -> np.ndarray:
    """Exact sequence log importance ratios log pi(y|x) - log pi_ref(y|x), as float64."""
    return (M.sequence_logprobs(policy, prompts, responses)
            - M.sequence_logprobs(reference, prompts, responses)).double().numpy()


def support(ess: float, khat: float, pop_ess: float, n: int, cfg) -> dict:
    """Whether importance weights with this ESS, tail shape and population ESS (ope_math.population_ess)
    can carry an estimate, and why not."""
    reasons = []
    if ess < cfg.min_ess:
        reasons.append(f"ESS {_below(ess)} < {cfg.min_ess:g} of {n}")
    if khat > cfg.max_khat:
        reasons.append(f"weight tail k-hat {math.ceil(khat * 100) / 100:.2f} > {cfg.max_khat:g}")
    if pop_ess < cfg.min_ess:
        reasons.append(f"population ESS {_below(pop_ess)} < {cfg.min_ess:g} of {n} (from the policy's own samples)")
    return {"certifiable": not reasons, "reason": "; ".join(reasons) if reasons else "ok"}


def _below(x: float) -> str:
    """A number under its threshold, rounded down (9.96 prints as 9.9, never as the 10.0 it is below)."""
    return f"{math.floor(x * 10) / 10:.1f}"


@torch.no_grad()
def weight_support(policy: M.Policy, reference: M.Policy, gold: list[dict], cfg) -> dict[str, dict]:
    """Per family of the expert set: ESS, k-hat, population ESS and whether certify could give it a
    number (certify draws the same policy samples: same seed, same order).

    Uses the expert prompts and responses and the policy's own samples, never the labels, so choosing
    among checkpoints by it does not bias the chosen one's certified estimate."""
    out = {}
    gen = torch.Generator().manual_seed(cfg.seed)
    by_family = D.group_by_family(gold)
    for f in [f for f in V.FAMILIES if f in by_family]:
        rows = by_family[f]
        prompts = D.prompts_tensor(rows)
        lw = log_ratios(policy, reference, prompts, D.responses_tensor(rows))
        own_lw = own_samples(policy, reference, prompts, cfg, gen)[2]
        ess, khat, pop = O.kish_ess(lw), O.pareto_khat(lw), O.population_ess(own_lw, len(rows))
        out[f] = {"ess": ess, "khat": khat, "pop_ess": pop, **support(ess, khat, pop, len(rows), cfg)}
    return out
