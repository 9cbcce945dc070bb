"""The evidence certify estimates from, per family of the expert set: the policy's and the reference's
log-probs of the expert responses, the policy's own samples (their log-ratios, population ESS, KL and
reward-model scores), and the flagged shortcuts' counts under both. `fixed_evidence` is the part that
does not depend on the policy (computed once by the watch). The policies and the reward model are any
implementation of core/protocol.py (our modules are wrapped: own_models.as_policy)."""
from __future__ import annotations

import numpy as np
import torch

from rlhf_mlflow.core import protocol as P
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core.own_models import as_policy, as_reward_model
from rlhf_mlflow.core.reward_wrapper import apply_wrapper
from rlhf_mlflow.decisions import ope_math as O
from rlhf_mlflow.evidence.overlap import own_samples


@torch.no_grad()
def family_evidence(policy, reference, rm, wrapper, gold: list[dict], cfg,
                    shortcuts: list[dict], gen: torch.Generator, fixed: dict | None = None) -> dict:
    """The arrays one family's estimates are computed from (numpy, one row per expert sample).
    `fixed` (fixed_evidence of the same rows), when given, is reused and no reference samples are
    drawn: the shortcuts counted are then those fixed_evidence counted under the reference (the
    watch, every few dozen training steps)."""
    return families_evidence(policy, reference, rm, wrapper, {"": gold}, cfg, gen,
                             None if fixed is None else {"": fixed}, shortcuts)[""]


@torch.no_grad()
def families_evidence(policy, reference, rm, wrapper, by_family: dict[str, list[dict]], cfg,
                      gen: torch.Generator, fixed: dict[str, dict] | None = None,
                      shortcuts: list[dict] = ()) -> dict[str, dict]:
    """family_evidence of several families at once, each model run once over all their rows (the
    watch: at two threads one pass over 600 rows costs half of six over 100). For one family the
    samples are family_evidence's, draw for draw."""
    policy, reference, rm = as_policy(policy), as_policy(reference), as_reward_model(rm)
    rows = [r for g in by_family.values() for r in g]
    K, prompts = cfg.samples_per_prompt, D.prompts_tensor(rows)
    prompts_rep = prompts.repeat_interleave(K, 0)
    own, ref_own, own_lw = own_samples(policy, reference, prompts, cfg, gen, with_reference=fixed is None)
    policy_lp = P.logprobs(policy, prompts, D.responses_tensor(rows))
    own_scores = None if rm is None else scores(rm, wrapper, [r for r in rows for _ in range(K)], prompts_rep, own)
    out, at = {}, 0
    for f, gold in by_family.items():
        mine, at = slice(at, at + len(gold)), at + len(gold)
        samples = slice(mine.start * K, mine.stop * K)
        if fixed is None:  # certify: the reference's counts from its own samples, drawn with the policy's
            fixed_f = fixed_evidence(reference, rm, wrapper, gold)
            counted = _reference_counts(_family_rules(shortcuts, gold), prompts_rep[samples], ref_own[samples])
        else:
            fixed_f = fixed[f]
            counted = fixed_f["shortcuts"]
        ev = {"log_ratios": (policy_lp[mine] - fixed_f["ref_logprobs"]).double().numpy(),
              "labels": np.array([r["label"] for r in gold], float),
              "prompts": [tuple(r["attrs"]) for r in gold],
              "ids": torch.cat([prompts[mine], D.responses_tensor(gold)], 1),
              "policy_ids": torch.cat([prompts_rep[samples], own[samples]], 1),
              "kl": float(own_lw[samples].mean()), "pop_ess": O.population_ess(own_lw[samples], len(gold)),
              "shortcuts": [_with_policy_count(rule, prompts_rep[samples], own[samples]) for rule in counted]}
        if rm is not None:
            ev["scores"] = fixed_f["scores"]
            ev["policy_scores_all"] = own_scores[samples]
            ev["policy_scores"] = own_scores[samples].reshape(len(gold), K).mean(1)  # per expert prompt
        out[f] = ev
    return out


@torch.no_grad()
def fixed_evidence(reference, rm, wrapper, gold: list[dict], shortcuts: list[dict] = (),
                   cfg=None, gen: torch.Generator | None = None) -> dict:
    """What family_evidence needs that does not depend on the policy: the reference's log-probs of
    the expert responses, their (corrected) reward-model scores, and the family's `shortcuts` with
    their mean count per answer in cfg.samples_per_prompt reference samples per expert prompt (drawn
    from `gen`)."""
    reference, rm = as_policy(reference), as_reward_model(rm)
    prompts, responses = D.prompts_tensor(gold), D.responses_tensor(gold)
    out = {"ref_logprobs": P.logprobs(reference, prompts, responses),
           "scores": None if rm is None else scores(rm, wrapper, gold, prompts, responses), "shortcuts": []}
    rules = _family_rules(shortcuts, gold)
    if rules:
        K = cfg.samples_per_prompt
        ref_own = P.sample(reference, prompts, K, cfg.temperature, gen)
        out["shortcuts"] = _reference_counts(rules, prompts.repeat_interleave(K, 0), ref_own)
    return out


def scores(rm, wrapper, records, prompts, responses) -> np.ndarray:
    """The reward model's scores of these responses, corrected by `wrapper` when given (float64)."""
    s = P.score(as_reward_model(rm), prompts, responses)
    if wrapper is not None:
        s = apply_wrapper(wrapper, getattr(wrapper, "path", "correction"), records, responses, s)
    return s.double().numpy()


def labelled_scores(rm, wrapper, labelled: dict[str, list[dict]]) -> dict[str, np.ndarray | None]:
    """Per family, the (corrected) reward model's scores of its labelled responses (None: no reward model)."""
    return {f: None if rm is None else scores(rm, wrapper, rows, D.prompts_tensor(rows), D.responses_tensor(rows))
            for f, rows in labelled.items()}


def _family_rules(shortcuts, gold: list[dict]) -> list[dict]:
    return [rule for rule in shortcuts if rule["family"] == gold[0]["family"]]


def _reference_counts(rules: list[dict], prompts_rep: torch.Tensor, ref_own: torch.Tensor) -> list[dict]:
    return [{**rule, "reference_count": _mean_count(rule, prompts_rep, ref_own)[0]} for rule in rules]


def _with_policy_count(rule: dict, prompts_rep: torch.Tensor, own: torch.Tensor) -> dict:
    mean, se = _mean_count(rule, prompts_rep, own)
    return {**rule, "policy_count": mean, "policy_count_se": se}


def _mean_count(rule: dict, prompts_rep: torch.Tensor, responses: torch.Tensor) -> tuple[float, float]:
    """The rule's mean count per answer over these responses, and its standard error."""
    c = SR.counts(rule, prompts_rep, responses).double()
    return float(c.mean()), float(c.std() / np.sqrt(len(c))) if len(c) > 1 else 0.0
