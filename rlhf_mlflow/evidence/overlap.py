"""The policy's own samples certify's overlap rule reads (decisions/overlap.py): K samples per expert
prompt from the policy and from the reference, the exact log importance ratios of any responses, and
`weight_support`: the rule applied without reading a label (how `main` chooses a checkpoint without
biasing its certified number). Policies are any implementation of core/protocol.py."""
from __future__ import annotations

import numpy as np
import torch

from rlhf_mlflow.core import protocol as P
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.own_models import as_policy
from rlhf_mlflow.decisions import ope_math as O
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.decisions.overlap import support


def own_samples(policy, reference, prompts, cfg, gen: torch.Generator, with_reference: bool = True):
    """K samples per prompt from the policy and from the reference (in that order on `gen`: certify
    and weight_support draw the same ones; None for the reference's without `with_reference`), and
    the log-ratios of the policy's own samples."""
    policy, reference = as_policy(policy), as_policy(reference)
    K = cfg.samples_per_prompt
    own_lp: list = []  # at temperature 1 the sampler's log-probs are the policy's: one forward pass saved
    own = P.sample(policy, prompts, K, cfg.temperature, gen, own_lp if cfg.temperature == 1.0 else None)
    ref_own = P.sample(reference, prompts, K, cfg.temperature, gen) if with_reference else None
    prompts_rep = prompts.repeat_interleave(K, 0)
    if not own_lp:
        return own, ref_own, log_ratios(policy, reference, prompts_rep, own)
    return own, ref_own, (own_lp[0] - P.logprobs(reference, prompts_rep, own)).double().numpy()


def log_ratios(policy, reference, prompts, responses) -> np.ndarray:
    """Exact sequence log importance ratios log pi(y|x) - log pi_ref(y|x), as float64."""
    policy, reference = as_policy(policy), as_policy(reference)
    return (P.logprobs(policy, prompts, responses) - P.logprobs(reference, prompts, responses)).double().numpy()


@torch.no_grad()
def weight_support(policy, reference, gold: list[dict], cfg: CertifyConfig = CertifyConfig()) -> dict[str, dict]:
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
