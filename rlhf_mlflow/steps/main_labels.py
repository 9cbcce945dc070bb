"""`main`'s label purchases: expert labels on a candidate's own responses, bought only where they can
change a decision and only as many as it takes.

A candidate is worth labels when certify refused some of its families off-policy while every
guardrail that needs no estimate already passes (family KL, marker collapse): the labels can only
help it there. Labels are bought in rounds (20 per refused family, then 10 more, up to 50), each
round re-certified; a family is certified from its labels once it has 20 (decisions/labelled.py),
and every interval is union-bounded over the rounds that may be looked at, so stopping as soon as
the guardrails are decided keeps them valid. A total budget caps what `main` spends.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions import guardrails as G
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.steps.certify import run_certify
from rlhf_mlflow.steps.expert_label import run_expert_label
from rlhf_mlflow.steps.label_requests import run_label_requests
from rlhf_mlflow.steps.main_resume import labels_in

ROUNDS = (20, 30, 40, 50)
"""Labels per refused family after each round."""


@dataclass
class LabelBudget:
    total: int
    """Labels `main` may buy over all its candidates."""
    spent: int = 0

    def afford(self, n: int) -> bool:
        return self.spent + n <= self.total


def families_worth_labels(report: dict, cfg: G.GuardrailConfig = G.GuardrailConfig()) -> list[str]:
    """The refused families, if every guardrail that needs no estimate passes; else none."""
    gates = G.evaluate(report, cfg, None)
    if not (gates["family_kl"][0] and gates["marker_collapse"][0]):
        return []
    return [f for f, r in report["families"].items() if not r["certifiable"]]


def decided(report: dict, cfg: G.GuardrailConfig = G.GuardrailConfig()) -> bool:
    """Every family certified, and no estimate-based guardrail's threshold inside its interval."""
    fams, bal = report["families"], report["balanced"]
    if not bal["certifiable"]:
        return False
    inside = lambda lo, hi, t: lo < t < hi  # noqa: E731
    if inside(bal["gain_lo"], bal["gain_hi"], cfg.min_balanced_gain) or inside(bal["gain_lo"], bal["gain_hi"], 0.0):
        return False
    return not any(inside(r["gain_lo"], r["gain_hi"], cfg.min_family_change) for r in fams.values())


def buy_labels(version: str, report: dict, world: WorldPaths, certify_kwargs: dict, budget: LabelBudget,
               out_dir: str, echo: Callable[[str], None], cfg: G.GuardrailConfig = G.GuardrailConfig(),
               expert_set_lines: Sequence[str] = ()) -> int:
    """Rounds of label requests -> expert labels -> certify for one candidate; returns labels used.
    `report`: its certification from the expert set alone, whose own lines (`expert_set_lines`) are
    printed only when no labels are bought, since they are then its verdict; before a purchase the log
    says what that pass was instead, and each look's line says how many labels it had (an expert
    set with fewer than k prompts in a family gets fewer than k). `cfg`: the guardrails its release
    will apply."""
    families = families_worth_labels(report, cfg)
    if families and budget.afford(len(families) * ROUNDS[0]):
        echo(f"expert set alone cannot certify v{version} ({', '.join(families)}): "
             f"buying {ROUNDS[0]} labels per family")
    else:
        for line in expert_set_lines:
            echo(line)
    used = 0
    for k in ROUNDS if families else ():
        cost = len(families) * (k - used // len(families))
        if not budget.afford(cost):
            echo(f"  version {version}: label budget left {budget.total - budget.spent} < {cost}: stop buying")
            break
        requests = os.path.join(out_dir, f"label_requests-v{version}.jsonl")
        labels = os.path.join(out_dir, f"labels-v{version}.jsonl")
        look = f"v{version}-k{k}"  # run names stay unique over the looks (and main's rounds)
        run_label_requests(version, world, ",".join(families), k, out=requests, echo=lambda m: None,
                           run_name=f"label-requests-{look}")
        run_expert_label(world, requests, labels, echo=lambda m: None, run_name=f"expert-label-{look}")
        held = labels_in(labels)  # an expert set with fewer than k prompts in a family gets fewer requests
        budget.spent += held - used
        used = held
        report = run_certify(version=version, world=world, policy_labels=labels,
                             echo=lambda line, n=held: echo(f"  {n} expert labels: {line}"),
                             cfg=CertifyConfig(label_looks=len(ROUNDS)), run_name=f"certify-{look}-labels",
                             **certify_kwargs)["report"]
        if decided(report):
            break
    if used:
        echo(f"  version {version}: {used} expert labels on its own responses ({', '.join(families)})")
    return used
