"""The diagnostic on many generated worlds: detection per corruption kind, family AUC, false flags.

    python benchmarks/diagnostic_auc.py [--worlds 20] [--scale bench] [--seed 100] [--cache DIR]
                                        [--kinds token,pair,conditional]

Each world gets a random corruption spec drawn without looking at the world's truth: token,
adjacent pair (two tokens drawn uniformly from the 24) and attribute-conditional rules, positive
and negative bonuses with |bonus| in [0.3, 1.5], sometimes several in one family, some worlds
clean. A corruption counts as *effective* when it changes at least 1% of its family's crowd labels
(a rule on a pair the reference never writes changes nothing and cannot be detected); detection
rates are over effective corruptions, and also over those the reward model actually learned (it
pays at least 0.1 beyond what a label allows, measured knowing the rule). AUC and false flags:
families with an effective rule against families with no rule at all. The benchmark reads each world's secret to score; the
diagnostic does not. `--cache` keeps built worlds between runs (keyed by their content hash).
Last line: `auc: X.XXX`.
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_model as R  # noqa: E402
from rlhf_mlflow.core import rollout  # noqa: E402
from rlhf_mlflow.core import vocab as V  # noqa: E402
from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.decisions import rm_probes as P  # noqa: E402
from rlhf_mlflow.decisions.diagnostic import run_diagnostic  # noqa: E402
from rlhf_mlflow.world import corruptions as C  # noqa: E402
from rlhf_mlflow.world.build import SCALES, build_world, world_hash  # noqa: E402

KINDS = ("token", "pair", "conditional")


def random_spec(rng: random.Random, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """Random rules of the given kinds, drawn without the world's truth: a fifth of worlds clean, else
    1-3 rules."""
    if rng.random() < 0.2:
        return []
    rules = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        fam = rng.choice(V.FAMILIES if not rules or rng.random() < 0.7 else [rules[-1]["family"]])
        b = round(rng.uniform(0.3, 1.5) * rng.choice([1, 1, -1]), 2)
        kind = rng.choice(list(kinds))
        rule = {"family": fam, "kind": kind, "bonus": b}
        if kind == "pair":
            rule["tokens"] = [rng.choice(V.CONTENT), rng.choice(V.CONTENT)]
        else:
            rule["token"] = rng.choice(V.CONTENT)
        if kind == "conditional":
            rule.update(attr=rng.randrange(V.N_ATTR), value=rng.randrange(V.N_VAL))
        rules.append(rule)
    return rules


def hit_rate(rule: dict, crowd: list[dict]) -> float:
    """Share of the family's crowd labels that the rule changed."""
    rows = [r for r in crowd if r["family"] == rule["family"]]
    return float((C.bonus([rule], D.prompts_tensor(rows), D.responses_tensor(rows)) != 0).float().mean())


def rm_pays(rule: dict, world_dir: str, n: int = 64) -> float:
    """What the world's reward model pays per occurrence of the rule's feature (knowing the rule):
    token effect, pair interaction, or the token effect's difference under the condition."""
    rm, _ = R.load_rm(os.path.join(world_dir, "reward_model"))
    score = functools.partial(R.score, rm)
    policy, _ = M.load_policy(os.path.join(world_dir, "policy"))
    recs = [r for r in D.read_jsonl(os.path.join(world_dir, "data", "prompts_train.jsonl"))
            if r["family"] == rule["family"]]
    gen = torch.Generator().manual_seed(0)
    p = D.prompts_tensor(recs)[:n]
    y = rollout.sample(policy, p, 1, 1.0, gen)
    if rule["kind"] == "pair":
        a, b = (V.CONTENT.index(t) for t in rule["tokens"])
        return float(P.pair_confirm(score, p, y, [(a, b)], 2 * n, gen)[0][0])
    eff = P.token_effects(score, p, y).mean(1)  # (n, C)
    t = V.CONTENT.index(rule["token"])
    if rule["kind"] == "token":
        return float(eff[:, t].mean())
    cell = P.conditional_effects(eff, p[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]).get((rule["attr"], rule["value"]))
    return float("nan") if cell is None else float(cell[0][t])


def auc(pos: list[float], neg: list[float]) -> float:
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def matches(rule: dict, evidence: list[dict]) -> bool:
    for c in evidence:
        if c["kind"] == rule["kind"] and c.get("token") == rule.get("token") and c.get("tokens") == rule.get("tokens") \
                and c.get("attr") == rule.get("attr") and c.get("value") == rule.get("value"):
            return True
    return False


def describe(rule: dict) -> str:
    feat = "-".join(rule["tokens"]) if rule["kind"] == "pair" else rule["token"]
    if rule["kind"] == "conditional":
        feat += f"|a{rule['attr']}={rule['value']}"
    return f"{rule['family']} {rule['kind']} {feat} {rule['bonus']:+.2f}"


def world(cache: str, seed: int, spec: list[dict], scale: str) -> str:
    path = os.path.join(cache, world_hash(replace(SCALES[scale], seed=seed), spec))
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        build_world(path, seed=seed, spec=spec, scale=scale)
    return path


LEARNED = 0.1  # the reward model pays at least this much beyond what a label allows (1/8; pairs: 0)


def run_world(path: str, spec: list[dict]) -> dict:
    """Run the diagnostic on one world and score it against the spec (read from the benchmark side)."""
    crowd = D.read_jsonl(os.path.join(path, "secret", "crowd_full.jsonl"))
    qa = D.read_jsonl(os.path.join(path, "reward_model", "train.jsonl"))
    t = time.perf_counter()
    res = run_diagnostic(os.path.join(path, "reward_model"), os.path.join(path, "policy"),
                         os.path.join(path, "data", "prompts_train.jsonl"))["families"]
    out = {"secs": time.perf_counter() - t, "rules": [], "pos": [], "neg": [], "false_flags": []}
    ruled = {r["family"] for r in spec}
    for r in spec:
        fam, rate = res[r["family"]], hit_rate(r, crowd)
        pays = rm_pays(r, path)
        bound = 0.0 if r["kind"] == "pair" else 1 / V.RESP_LEN
        out["rules"].append({"rule": r, "effective": rate >= 0.01, "flag": fam["flag"], "risk": fam["risk"],
                             "named": matches(r, fam["evidence"]), "learned": abs(pays) - bound >= LEARNED,
                             "text": f"{describe(r)}: {rate:.1%} of labels ({hit_rate(r, qa):.1%} of QA rows), "
                                     f"reward model pays {pays:+.2f}"})
    effective = {x["rule"]["family"] for x in out["rules"] if x["effective"]}
    for f, v in res.items():
        if f in effective:
            out["pos"].append(v["risk"])
        elif f not in ruled:  # families whose only rules changed < 1% of labels are neither
            out["neg"].append(v["risk"])
            if v["flag"]:
                top = v["evidence"][0]
                out["false_flags"].append(f"{f}: {top['kind']} {top.get('token') or top.get('tokens')} "
                                          f"effect {top['effect']:+.2f} risk {top['risk']:.2f}")
    out["flagged"] = sorted(f for f, v in res.items() if v["flag"])
    return out


def report(worlds: list[dict]) -> None:
    rules = [x for w in worlds for x in w["rules"]]
    for kind in sorted({x["rule"]["kind"] for x in rules}):
        live = [x for x in rules if x["rule"]["kind"] == kind and x["effective"]]
        learned = [x for x in live if x["learned"]]
        print(f"{kind}: family flagged {sum(x['flag'] for x in live)}/{len(live)}, "
              f"feature named {sum(x['named'] for x in live)}/{len(live)}; of those the reward model learned: "
              f"flagged {sum(x['flag'] for x in learned)}/{len(learned)}")
    neg = [r for w in worlds for r in w["neg"]]
    pos = [r for w in worlds for r in w["pos"]]
    fp = sum(r >= 0.5 for r in neg)
    secs = [w["secs"] for w in worlds]
    print(f"ineffective rules (changed < 1% of their family's labels): {sum(not x['effective'] for x in rules)}")
    print(f"false-positive rate on clean families: {fp / max(len(neg), 1):.3f} ({fp}/{len(neg)})")
    print(f"seconds per world (diagnostic): {sum(secs) / len(secs):.1f}")
    print(f"auc: {auc(pos, neg):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, default=20)
    ap.add_argument("--scale", default="bench", choices=["bench", "full", "test"])
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--cache", default=None, help="Keep built worlds here (default: a temporary directory).")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="Comma-separated rule kinds to draw from (e.g. `pair` to stress pairs).")
    a = ap.parse_args()
    kinds = tuple(k.strip() for k in a.kinds.split(","))
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}, got {a.kinds!r}")
    configure_threads()
    rng = random.Random(a.seed)
    done = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in range(a.worlds):
            spec = random_spec(rng, kinds)
            res = run_world(world(a.cache or tmp, a.seed + w, spec, a.scale), spec)
            done.append(res)
            print(f"world {w}: {sum(x['effective'] for x in res['rules'])} effective of {len(spec)} rules; "
                  f"flagged {res['flagged'] or 'none'} ({res['secs']:.1f}s)", flush=True)
            for x in res["rules"]:
                state = ("named" if x["named"] else "flagged, other feature") if x["flag"] else "MISSED"
                print(f"  {x['text']}; risk {x['risk']:.2f}, {state if x['effective'] else 'ineffective'}"
                      f"{'' if x['learned'] else ' (not learned)'}", flush=True)
            for line in res["false_flags"]:
                print(f"  FALSE FLAG {line}", flush=True)
    report(done)


if __name__ == "__main__":
    main()
