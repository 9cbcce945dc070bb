"""`main`'s label purchases: expert labels on a candidate's own responses, bought only where they can
change a decision and only as many as it takes.

A candidate is worth labels when certify refused some of its families off-policy while every
guardrail that needs no estimate already passes (family KL, marker collapse), and its reward model's
own estimate says it could beat the champion, and the round's candidates certified before it (Purchases:
a round buys once its candidates have all trained, the most promising first): the labels can only help
it there. Labels are bought in
rounds (20 per refused family, then 10 more, up to 50), each round re-certified; a family is certified
from its labels once it has 20 (decisions/labelled.py), and each look's interval has its share of the
error budget (SPENDING, fixed before the first look; the look counted from the store), so stopping
whenever the buyer likes keeps them valid. It stops once the guardrails are decided, or once the last
round would not decide them either (`futile`). A total budget caps what `main` spends; the ledger
(LEDGER) records every purchase.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import NamedTuple

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import read_json
from rlhf_mlflow.core.files import atomic_write_json
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions import guardrails as G
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.steps.certify import run_certify
from rlhf_mlflow.steps.expert_label import run_expert_label
from rlhf_mlflow.steps.label_requests import run_label_requests
from rlhf_mlflow.steps.main.resume import labels_in
from rlhf_mlflow.tracking import registry as REG

ROUNDS = (20, 30, 40, 50)
"""Labels per refused family after each round."""
SPENDING = "0.7,0.1,0.1,0.1"
"""The error budget's share at each of the ROUNDS looks, fixed before the first (CertifyConfig.label_spending):
every candidate `main` bought labels for on the default world stopped at the first look, where the
union bound over four looks charged t(1 - 0.10/8) = 2.43 standard errors at 20 labels and this rule
t(1 - 0.07/2) = 1.92 (a fifth narrower); the later looks keep 0.01 each (2.9 standard errors)."""


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


def open_thresholds(report: dict, cfg: G.GuardrailConfig = G.GuardrailConfig()) -> list[tuple] | None:
    """(estimate, lo, hi, threshold) of every estimate-based guardrail threshold inside its interval (the
    balanced gain's 0 and min_balanced_gain, each family gain's min_family_change); None when the balanced
    quality is not certified (more labels may certify it)."""
    fams, bal = report["families"], report["balanced"]
    if not bal["certifiable"]:
        return None
    rows = [(bal, t) for t in (cfg.min_balanced_gain, 0.0)] + [(r, cfg.min_family_change) for r in fams.values()]
    return [(r["gain"], r["gain_lo"], r["gain_hi"], t) for r, t in rows if r["gain_lo"] < t < r["gain_hi"]]


def decided(report: dict, cfg: G.GuardrailConfig = G.GuardrailConfig()) -> bool:
    """Every family certified, and no estimate-based guardrail's threshold inside its interval."""
    return open_thresholds(report, cfg) == []


def futile(report: dict, labels_now: int, labels_last: int, cfg: G.GuardrailConfig = G.GuardrailConfig()) -> bool:
    """Whether the last look would most likely not decide it either: a threshold inside its interval now
    would still be inside the interval it would have at `labels_last` per family (the half-width shrunk
    by sqrt(labels_now / labels_last)) even after its estimate moved a standard deviation of what the
    new labels add (half-width / z, times sqrt(1 - labels_now / labels_last)) away from the threshold.
    On the benchmark world an estimate that stayed put was not enough: one moved 0.6 of that and decided."""
    shrink, z = math.sqrt(labels_now / labels_last), NormalDist().inv_cdf(0.95)
    for est, lo, hi, t in open_thresholds(report, cfg) or []:
        half = (hi - lo) / 2
        if abs(est - t) + half / z * math.sqrt(1 - shrink ** 2) < half * shrink:
            return True
    return False


def stop_reason(report: dict, labels_now: int, cfg: G.GuardrailConfig = G.GuardrailConfig()) -> str | None:
    """Why `main` buys no more labels for a candidate after a look at `labels_now` per family: "decided",
    "futile" (before the last round), or None (buy the next round)."""
    if decided(report, cfg):
        return "decided"
    return "futile" if labels_now < ROUNDS[-1] and futile(report, labels_now, ROUNDS[-1], cfg) else None


LEDGER = "labels_bought.json"
"""main's record of its expert labels: per purchase (purpose, round, version), the labels per family."""
PURPOSES = ("certify", "repair")


def note_purchase(out_dir: str, purpose: str, round_: int, version: str, labels_path: str) -> None:
    """Record (or, for a purchase made again after a resume, replace) what `labels_path` holds."""
    path = os.path.join(out_dir, LEDGER)
    ledger = read_json(path) if os.path.isfile(path) else {}
    families: dict[str, int] = {}
    for rec in D.read_jsonl(labels_path, labelled=True, scale=D.EXPERT):
        families[rec["family"]] = families.get(rec["family"], 0) + 1
    ledger[f"{purpose}/r{round_}/v{version}"] = {"purpose": purpose, "round": round_, "version": str(version),
                                                 "file": os.path.basename(labels_path), "families": families,
                                                 "labels": sum(families.values())}
    atomic_write_json(path, ledger)


def purchases(out_dir: str) -> list[dict]:
    """The ledger's purchases, by round, then certification before repair."""
    path = os.path.join(out_dir, LEDGER)
    rows = list(read_json(path).values()) if os.path.isfile(path) else []
    return sorted(rows, key=lambda r: (r["round"], PURPOSES.index(r["purpose"]), int(r["version"])))


def predicted_balanced(report: dict) -> float | None:
    """The candidate's balanced quality as its certification's point estimates say before any label: the
    certified estimate where a family has one, else the predictor's doubly-robust (or direct) estimate on
    the policy's samples, which nothing vouches for (a screen for spending, never evidence)."""
    vals = []
    for f, w in report["balanced"].get("weights", {}).items():
        r = report["families"].get(f, {})
        v = next((r.get(k) for k in ("estimate", "doubly_robust", "direct") if r.get(k) is not None), None)
        if v is None:
            return None
        vals.append(w * v)
    return sum(vals) if vals else None


def could_beat_champion(report: dict, rivals: dict[str, float] | None = None) -> tuple[bool, str]:
    """Whether labels could make this candidate the champion: its predicted balanced quality above the
    champion's certified lower bound (beats_champion needs its certified estimate above the champion's
    estimate), and above every lower bound in `rivals` (name -> lower bound: this round's candidates
    certified with every guardrail passing, one of which release will promote unless a better one
    comes). True with nothing to compare."""
    bars = dict(rivals or {})
    champion = REG.champion_version()
    if champion is not None:
        bal = REG.champion_certification(champion)["balanced"]
        if bal.get("certifiable"):
            bars[f"champion v{champion.version}"] = bal["lo"]
    guess = predicted_balanced(report)
    if not bars or guess is None:
        return True, ""
    who, lo = max(bars.items(), key=lambda kv: kv[1])
    if guess > lo:
        return True, ""
    return False, f"its reward model's estimate {guess:.3f} is below {who}'s certified lower bound {lo:.3f}"


def releasable(report: dict, cfg: G.GuardrailConfig) -> bool:
    """Whether release would promote this certification now (every guardrail, against today's champion)."""
    champion = REG.champion_version()
    against = REG.champion_certification(champion) if champion is not None else None
    return all(ok for ok, _ in G.evaluate(report, cfg, against).values())


@dataclass
class Purchases:
    """A round's label purchases, made once all its candidates have trained, the most promising first
    (predicted_balanced): each is screened against the champion and against the round's candidates already
    certified with every guardrail passing (could_beat_champion), so a candidate the round's best beats
    anyway buys nothing, whichever of them finished training first."""
    world: WorldPaths
    out_dir: str
    budget: LabelBudget
    gates: G.GuardrailConfig
    echo: Callable[[str], None]
    pending: list = field(default_factory=list)

    def add(self, version: str, report: dict, inputs: dict, expert_set_lines: Sequence[str], round_: int,
            done: Callable[[], None]) -> None:
        """A candidate's certification from the expert set alone; `done` runs once its purchase is over."""
        self.pending.append(Pending(version, report, inputs, tuple(expert_set_lines), round_, done))

    def settle(self) -> None:
        def promise(p: Pending) -> float:
            guess = predicted_balanced(p.report)
            return -math.inf if guess is None else guess
        rivals: dict[str, float] = {}
        order, self.pending = sorted(self.pending, key=promise, reverse=True), []
        for p in order:
            final = buy_labels(p.version, p.report, self.world, p.inputs, self.budget, self.out_dir, self.echo,
                               self.gates, p.expert_set_lines, p.round_, rivals)
            if final["balanced"].get("certifiable") and releasable(final, self.gates):
                rivals[f"v{p.version} (this round)"] = final["balanced"]["lo"]
            p.done()


class Pending(NamedTuple):
    """A candidate waiting for its label purchase (Purchases.add's arguments)."""
    version: str
    report: dict
    inputs: dict
    expert_set_lines: tuple[str, ...]
    round_: int
    done: Callable[[], None]


def buy_labels(version: str, report: dict, world: WorldPaths, certify_kwargs: dict, budget: LabelBudget,
               out_dir: str, echo: Callable[[str], None], cfg: G.GuardrailConfig = G.GuardrailConfig(),
               expert_set_lines: Sequence[str] = (), round_: int = 1, rivals: dict[str, float] | None = None
               ) -> dict:
    """Rounds of label requests -> expert labels -> certify for one candidate; returns its last
    certification (`report` when nothing was bought). `rivals`: could_beat_champion's.
    `report`: its certification from the expert set alone, whose own lines (`expert_set_lines`) are
    printed only when no labels are bought, since they are then its verdict; before a purchase the log
    says what that pass was instead, and each look's line says how many labels it had (an expert
    set with fewer than k prompts in a family gets fewer than k). `cfg`: the guardrails its release
    will apply."""
    families = families_worth_labels(report, cfg)
    worth, why_not = could_beat_champion(report, rivals) if families else (True, "")
    if not worth:
        echo(f"v{version}: no labels bought for {', '.join(families)}: {why_not}")
        families = []
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
        note_purchase(out_dir, "certify", round_, version, labels)
        report = run_certify(version=version, world=world, policy_labels=labels,
                             echo=lambda line, n=held: echo(f"  {n} expert labels: {line}"),
                             cfg=CertifyConfig(label_spending=SPENDING), run_name=f"certify-{look}-labels",
                             **certify_kwargs)["report"]
        stop = stop_reason(report, k, cfg)
        if stop == "futile":
            echo(f"  version {version}: {ROUNDS[-1]} labels per family would not decide it either: stop buying")
        if stop:
            break
    if used:
        echo(f"  version {version}: {used} expert labels on its own responses ({', '.join(families)})")
    return report


def purchases_markdown(rows: list[dict]) -> str:
    """The ledger as a table: a row per purchase, a column per family, and the totals per purpose."""
    if not rows:
        return ""
    fams = sorted({f for r in rows for f in r["families"]}, key=lambda f: (f not in V.FAMILIES, f))
    head = "| round | bought for | on version | " + " | ".join(fams) + " | labels |\n|" + "---|" * (len(fams) + 4) + "\n"
    body = "".join(f"| {r['round']} | {r['purpose']} | v{r['version']} | "
                   + " | ".join(str(r["families"].get(f, 0)) for f in fams) + f" | {r['labels']} |\n" for r in rows)
    totals = ", ".join(f"{p} {sum(r['labels'] for r in rows if r['purpose'] == p)}" for p in PURPOSES)
    return f"\n## Expert labels bought\n\n{head}{body}\nIn all {sum(r['labels'] for r in rows)} ({totals}).\n"


def purchase_metrics(rows: list[dict]) -> dict[str, float]:
    """`expert_labels/<purpose>`: labels bought per purpose over the whole run."""
    return {f"expert_labels/{p}": float(sum(r["labels"] for r in rows if r["purpose"] == p)) for p in PURPOSES}
