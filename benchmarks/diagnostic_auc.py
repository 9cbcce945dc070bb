"""The diagnostic and its correction on many generated worlds, by how much the reward model learned.

    python benchmarks/diagnostic_auc.py [--worlds 20] [--scale bench] [--seed 100] [--cache DIR]
                                        [--kinds token,pair,conditional] [--no-gold] [--cached-only]

Each world gets a random corruption spec drawn without looking at the world's reward model: token,
adjacent-pair and attribute-conditional rules of either sign, most of them weak (|bonus| 0.1-0.4 in
the labels, so that the reward model learns 0.05-0.3), the rest 0.4-1.5; several rules in one family
at times; some worlds clean. Pairs are drawn among the eight the reference writes most often in the
family (from the world's demonstrator distribution), so that the reward model sees them enough to
learn them. The benchmark reads each world's secret to score; the diagnostic does not.

What the reward model *pays* for a rule is measured knowing the rule and the truth: for a token, at
places where it is not the correct token, its score minus the median score of the other wrong tokens
there; for a condition, that premium under the condition minus elsewhere; for a pair, its
interaction (a fraction-correct label has none). Families are banded by the largest premium paid
for any of their rules; AUC is against the families with no rule at all, which also give the
false-positive rate. The correction's error is (correction's bonus - paid) / |paid| over the rules
paid >= 0.1 that were flagged and named (a rule flagged but left out of the correction counts -100%).
`--cache` keeps built worlds between runs (keyed by their content hash); `--cached-only` runs only
the worlds found there.
Last lines: `auc_weak: X` (families paid 0.1-0.3), `correction_rel_err: Y` (median |error|).
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_model as R  # noqa: E402
from rlhf_mlflow.core import rollout  # noqa: E402
from rlhf_mlflow.core import shortcut_rules as SR  # noqa: E402
from rlhf_mlflow.core import vocab as V  # noqa: E402
from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.decisions import rm_probes as P  # noqa: E402
from rlhf_mlflow.decisions.correction import fit_corrections  # noqa: E402
from rlhf_mlflow.evidence.diagnostic import run_diagnostic  # noqa: E402
from rlhf_mlflow.world import corruptions as C  # noqa: E402
from rlhf_mlflow.world.build import SCALES, build_world, world_hash  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402
from rlhf_mlflow.world.reference import confusion_tables, demonstrator_distribution  # noqa: E402
from rlhf_mlflow.world.truth import Truth  # noqa: E402

KINDS = ("token", "pair", "conditional")
BANDS = ((0.0, 0.1), (0.1, 0.2), (0.2, 0.3), (0.3, 0.6), (0.6, 99.0))
LEARNED = 0.1  # acceptance is over families paid at least this much per occurrence


def frequent_pairs(seed: int, scale: str, n: int = 8) -> dict[str, list[list[str]]]:
    """Per family, the n adjacent pairs the world's demonstrators write most often (the reference is
    trained to imitate them): Truth and confusions are drawn first from the build's generator."""
    cfg = SCALES[scale]
    rng = np.random.default_rng(seed)
    truth = Truth.generate(rng, cfg.shared_table)
    conf = confusion_tables(rng)
    draw = np.random.default_rng(seed + 1)
    out = {}
    for f in V.FAMILIES:
        attrs = draw.integers(0, V.N_VAL, size=(400, V.N_ATTR))
        dist = demonstrator_distribution(truth, conf, np.full(400, V.FAMILIES.index(f)), attrs,
                                         cfg.demo_noise, cfg.demo_confusion)         # (N, L, C)
        rate = np.einsum("npa,npb->ab", dist[:, :-1], dist[:, 1:]) / len(attrs)      # (C, C)
        out[f] = [[V.CONTENT[k // V.N_CONTENT], V.CONTENT[k % V.N_CONTENT]] for k in np.argsort(-rate, None)[:n]]
    return out


def random_spec(rng: random.Random, pairs: dict[str, list[list[str]]], kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """Random rules drawn without the world's reward model: 15% of worlds clean, else 1-4 rules."""
    if rng.random() < 0.15:
        return []
    rules: list[dict] = []
    for _ in range(rng.choice([1, 2, 2, 3, 3, 4])):
        fam = rng.choice(V.FAMILIES if not rules or rng.random() < 0.75 else [rules[-1]["family"]])
        size = rng.uniform(0.1, 0.4) if rng.random() < 0.7 else rng.uniform(0.4, 1.5)
        kind = rng.choice(list(kinds))
        rule = {"family": fam, "kind": kind, "bonus": round(size * rng.choice([1, 1, -1]), 2)}
        if kind == "pair":
            rule["tokens"] = list(rng.choice(pairs[fam]))
        else:
            rule["token"] = rng.choice(V.CONTENT)
        if kind == "conditional":
            rule.update(attr=rng.randrange(V.N_ATTR), value=rng.randrange(V.N_VAL))
        if all(SR.feature(rule, fam) != SR.feature(r, r["family"]) for r in rules):
            rules.append(rule)
    return rules


def hit_rate(rule: dict, crowd: list[dict]) -> float:
    """Share of the family's crowd labels that the rule changed."""
    rows = [r for r in crowd if r["family"] == rule["family"]]
    return float((C.bonus([rule], D.prompts_tensor(rows), D.responses_tensor(rows)) != 0).float().mean())


def _probe_prompts(rule: dict, world_dir: str, n: int) -> torch.Tensor:
    """n prompts of the rule's family; for a condition, half of them under it."""
    recs = [r for r in D.read_jsonl(os.path.join(world_dir, "data", "prompts_train.jsonl"))
            if r["family"] == rule["family"]]
    if rule["kind"] == "conditional":
        on = [r for r in recs if r["attrs"][rule["attr"]] == rule["value"]]
        recs = on[:n // 2] + [r for r in recs if r not in on][:n - len(on[:n // 2])]
    return D.prompts_tensor(recs[:n])


def rm_pays(rule: dict, world_dir: str, oracle: Oracle, n: int = 96) -> float:
    """What the world's reward model pays per occurrence of the rule's feature beyond correctness
    (knowing the rule and the truth; see the module docstring)."""
    rm, _ = R.load_rm(os.path.join(world_dir, "reward_model"))
    score = functools.partial(R.score, rm)
    policy, _ = M.load_policy(os.path.join(world_dir, "policy"))
    gen = torch.Generator().manual_seed(0)
    p = _probe_prompts(rule, world_dir, n)
    y = rollout.sample(policy, p, 1, 1.0, gen)
    if rule["kind"] == "pair":
        a, b = (V.CONTENT.index(t) for t in rule["tokens"])
        return float(P.pair_confirm(score, p, y, [(a, b)], 4 * n, gen)[0][0])
    eff = P.token_effects(score, p, y)                                   # (n, L, C)
    t = V.CONTENT.index(rule["token"])
    correct = oracle.truth.target_ids(p) - V.CONTENT_LO                  # (n, L)
    others = eff.clone()
    others.scatter_(2, correct[..., None], torch.nan)                    # the correct token is not a wrong one
    others[..., t] = torch.nan
    premium = eff[..., t] - others.nanquantile(0.5, dim=2)               # (n, L): against a typical wrong token
    premium = torch.where(correct == t, torch.nan, premium)             # only where t is wrong
    if rule["kind"] == "token":
        return float(premium.nanmean())
    on = (p[:, 1 + rule["attr"]] - V.VAL_ID[0]) == rule["value"]
    return float(premium[on].nanmean() - premium[~on].nanmean())


def auc(pos: list[float], neg: list[float]) -> float:
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def cached(cache: str, seed: int, spec: list[dict], scale: str) -> str:
    """Where the world is (or would be) kept in the cache."""
    return os.path.join(cache, world_hash(replace(SCALES[scale], seed=seed), spec))


def world(cache: str, seed: int, spec: list[dict], scale: str) -> str:
    path = cached(cache, seed, spec, scale)
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        build_world(path, seed=seed, spec=spec, scale=scale)
    return path


def _describe(rule: dict) -> str:
    return f"{rule['family']} {rule['kind']} {SR.describe(rule)} {rule['bonus']:+.2f}"


def _score_rule(r: dict, fam: dict, corrections: list[dict], path: str, oracle: Oracle, crowd, qa) -> dict:
    rate, pays = hit_rate(r, crowd), rm_pays(r, path, oracle)
    named = SR.feature(r, r["family"]) in [SR.feature(c, r["family"]) for c in fam["evidence"]
                                           if c["risk"] >= SR.FLAG_RISK]
    fix = [c for c in corrections if SR.feature(c, c["family"]) == SR.feature(r, r["family"])]
    return {"rule": r, "effective": rate >= 0.01, "flag": fam["flag"], "risk": fam["risk"], "named": named,
            "pays": pays, "corrected": fix[0]["bonus"] if fix else 0.0,
            "label_slope": fix[0].get("label_slope") if fix else None,
            "text": f"{_describe(r)}: {rate:.1%} of labels ({hit_rate(r, qa):.1%} of QA rows), "
                    f"reward model pays {pays:+.3f}"}


def run_world(path: str, spec: list[dict], gold: bool) -> dict:
    """Run the diagnostic and the correction on one world; score them against the spec."""
    crowd = D.read_jsonl(os.path.join(path, "secret", "crowd_full.jsonl"))
    qa = D.read_jsonl(os.path.join(path, "reward_model", "train.jsonl"))
    oracle = Oracle(path)
    t = time.perf_counter()
    kw = {"gold_path": os.path.join(path, "data", "gold_calib.jsonl")} if gold else {}
    diag = run_diagnostic(os.path.join(path, "reward_model"), os.path.join(path, "policy"),
                          os.path.join(path, "data", "prompts_train.jsonl"), **kw)
    secs = time.perf_counter() - t
    corrections = fit_corrections(diag, qa)
    res = diag["families"]
    rules = [_score_rule(r, res[r["family"]], corrections, path, oracle, crowd, qa) for r in spec]
    fams = {}
    for x in rules:
        f = x["rule"]["family"]
        fams[f] = max(fams.get(f, 0.0), abs(x["pays"]) if x["effective"] else 0.0)
    clean = {f: res[f] for f in res if f not in fams}
    false_flags = [f"{f}: {v['evidence'][0]['kind']} {SR.describe(v['evidence'][0])} risk {v['risk']:.2f}"
                   for f, v in clean.items() if v["flag"]]
    return {"secs": secs, "rules": rules, "flagged": sorted(f for f, v in res.items() if v["flag"]),
            "pos": [(fams[f], res[f]["risk"], res[f]["flag"]) for f in fams],
            "neg": [v["risk"] for v in clean.values()], "neg_flags": [v["flag"] for v in clean.values()],
            "false_flags": false_flags}


def _correction_errors(rules: list[dict]) -> list[float]:
    paid = [x for x in rules if x["effective"] and x["flag"] and x["named"] and abs(x["pays"]) >= LEARNED]
    return [(x["corrected"] - x["pays"]) / abs(x["pays"]) * (1 if x["pays"] > 0 else -1) for x in paid]


def report(worlds: list[dict]) -> None:
    neg = [r for w in worlds for r in w["neg"]]
    fp = sum(f for w in worlds for f in w["neg_flags"])
    pos = [x for w in worlds for x in w["pos"]]
    rules = [x for w in worlds for x in w["rules"]]
    print(f"clean families: {len(neg)}, flagged {fp} (FPR {fp / max(len(neg), 1):.3f})")
    print("band (paid)  families  flagged  AUC    rules named/flagged-family")
    for lo, hi in BANDS:
        band = [x for x in pos if lo <= x[0] < hi]
        rb = [x for x in rules if x["effective"] and lo <= abs(x["pays"]) < hi]
        print(f"{lo:.1f}-{hi if hi < 9 else 'inf':<5}    {len(band):>4}      {sum(x[2] for x in band):>4}   "
              f"{auc([x[1] for x in band], neg):.3f}  {sum(x['named'] for x in rb)}/{sum(x['flag'] for x in rb)}"
              f" of {len(rb)}")
    strong = [x[1] for x in pos if x[0] >= LEARNED]
    weak = [x[1] for x in pos if LEARNED <= x[0] < 0.3]
    errs = _correction_errors(rules)
    print(f"rules paid >= {LEARNED} flagged and named: {len(errs)}; correction error vs paid: "
          + (f"median |err| {statistics.median(abs(e) for e in errs):.3f}, max over {max(errs):+.3f}, "
             f"min {min(errs):+.3f}" if errs else "none"))
    print(f"seconds per world (diagnostic): {statistics.mean(w['secs'] for w in worlds):.1f}")
    print(f"auc: {auc(strong, neg):.3f}")
    print(f"auc_weak: {auc(weak, neg):.3f}")
    print(f"correction_rel_err: {statistics.median(abs(e) for e in errs) if errs else float('nan'):.3f}")


def _print_world(w: int, res: dict, n_rules: int) -> None:
    print(f"world {w}: {n_rules} rules; flagged {res['flagged'] or 'none'} ({res['secs']:.1f}s)", flush=True)
    for x in res["rules"]:
        state = ("named" if x["named"] else "flagged, other feature") if x["flag"] else "MISSED"
        fix = f"; corrected {x['corrected']:+.3f} (label slope {x['label_slope']})" if x["corrected"] else ""
        print(f"  {x['text']}; risk {x['risk']:.2f}, {state if x['effective'] else 'ineffective'}{fix}", flush=True)
    for line in res["false_flags"]:
        print(f"  FALSE FLAG {line}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, default=20)
    ap.add_argument("--scale", default="bench", choices=["bench", "full", "test"])
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--cache", default=None, help="Keep built worlds here (default: a temporary directory).")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="Comma-separated rule kinds to draw from (e.g. `pair` to stress pairs).")
    ap.add_argument("--no-gold", action="store_true", help="Run the diagnostic without the expert set.")
    ap.add_argument("--build-only", action="store_true", help="Build (or find) the worlds, run nothing.")
    ap.add_argument("--cached-only", action="store_true",
                    help="Build nothing: run only the worlds already in --cache (say which were skipped).")
    a = ap.parse_args()
    kinds = tuple(k.strip() for k in a.kinds.split(","))
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}, got {a.kinds!r}")
    configure_threads()
    rng = random.Random(a.seed)
    done = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in range(a.worlds):
            spec = random_spec(rng, frequent_pairs(a.seed + w, a.scale), kinds)
            if a.cached_only and not os.path.isfile(os.path.join(cached(a.cache or tmp, a.seed + w, spec, a.scale),
                                                                 "manifest.json")):
                print(f"world {w}: not in the cache, skipped", flush=True)
                continue
            path = world(a.cache or tmp, a.seed + w, spec, a.scale)
            if a.build_only:
                print(f"world {w}: {path} {[_describe(r) for r in spec]}", flush=True)
                continue
            done.append(run_world(path, spec, gold=not a.no_gold))
            _print_world(w, done[-1], len(spec))
    if done:
        report(done)


if __name__ == "__main__":
    main()
