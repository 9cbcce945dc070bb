"""How close is certification to the truth a user reads it as? Over several worlds, expert-set sizes and
policies from near to far drift, compare the certified quality (per family and balanced) with the
policy's true quality, and count refusals; with `--policy-labels`, also certification from K expert
labels on the policy's own samples per family (issue 17).

    python benchmarks/certify_accuracy.py [--world D ...] [--gold-sizes 100] [--policy-labels 0,25,50,100]

The estimand is the policy's expected true quality on the family's prompt distribution (deployment
traffic): the **deployment truth** is the oracle's mean true quality of the policy's samples (8 per
prompt, temperature 1) on `--truth-prompts` fresh prompts per family drawn as the world builder draws
prompts (family, then every attribute uniform), never the expert prompts. The old reference, the oracle
on the expert prompts themselves (8 per prompt), is reported beside it (`cover_xp`).

Worlds: each `--world D` is an already built world (its manifest gives the setting: SFT epochs and
confusion, i.e. the reference's entropy; crowd noise); each `--setting NAME:SEED` a bench world of a
named setting (SETTINGS) built once under `--cache`; without either, `--worlds` bench-scale worlds from
`--seed` are built once and cached under `--cache`. Expert-set sizes (`--gold-sizes`): 100 is the
world's own set; fewer is a seeded subset of it; more adds rows drawn as the builder draws them (the
reference at temperature 1 on fresh prompts, labelled truth + the world's gold noise). Per world the
gold-free diagnostic and its correction are fitted as the pipeline does; policies are trained once and
kept under `--work/<world>/<policy>` (an existing one is reused). Certification runs with the reward
model, the correction and the default CertifyConfig (`--ess-widening` overrides its widening).

Prints, per setting, K and method: cells, certified, MAE, bias, 90%-interval coverage of the deployment
truth (and of the expert-prompt truth), mean width, and a 90% bootstrap interval of the coverage over
expert sets (one set's errors are shared by every policy certified from it: with 6 sets a world's
coverage is uncertain by several points). At every K > 0 the methods are side by side on the same labels
and the same predictor (benchmarks/ppi_reference.py): `ours` (certify: the expert set and the labels
joined where the expert set vouches, else the labels alone, else refused), `ppi_py` (ppi_py.ppi_mean_ci,
the authors' PPI++; needs the bench extra, `pip install -e '.[bench]'`, or `--no-ppi-py`) and `classical`
(the labels alone, a t interval); then ours' width over ppi_py's on the cells both certified.
`--cells F` reports the cells of earlier `--out` runs, pooled, computing nothing; `--arrays F` keeps every
labelled cell's arrays to try estimators offline. Last lines: `deployment_coverage: X` (off-policy,
family level, K = 0, the minimum over settings), `labelled_coverage: X` (ours, family level, K = 50, the
minimum over settings), `coverage_k20: X` (ours, family level, K = 20, pooled over settings),
`width_ratio_vs_ppi_k20: Y` and `width_ratio_vs_ppi_k50: Z` (ours' mean family width over ppi_py's, same
cells).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_model as R  # noqa: E402
from rlhf_mlflow.core import rollout  # noqa: E402
from rlhf_mlflow.core import vocab as V  # noqa: E402
from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.core.reward_wrapper import load_wrapper  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.decisions import certify as C  # noqa: E402
from rlhf_mlflow.decisions.correction import fit_corrections, write_wrapper  # noqa: E402
from rlhf_mlflow.evidence.certify_evidence import family_evidence, labelled_scores  # noqa: E402
from rlhf_mlflow.evidence.diagnostic import run_diagnostic  # noqa: E402
from rlhf_mlflow.evidence.label_requests import draw_requests  # noqa: E402
from rlhf_mlflow.training.rl_config import load_rl_config  # noqa: E402
from rlhf_mlflow.training.train_rl import train_rl  # noqa: E402
from rlhf_mlflow.world.annotator import label_requests  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402

from benchmarks.certify_arrays import KEPT, recompute  # noqa: E402
from benchmarks.ppi_reference import INSTALL, reference_rows  # noqa: E402

POLICIES = {
    "corrected-kl0.1-s300": ({"kl_coef": 0.1, "steps": 300}, True),
    "corrected-kl0.1-s800": ({"kl_coef": 0.1, "steps": 800}, True),
    "corrected-kl0.05-s600": ({"kl_coef": 0.05, "steps": 600}, True),
    "raw-kl0.1-s300": ({"kl_coef": 0.1, "steps": 300}, False),
    "raw-kl0.1-s800": ({"kl_coef": 0.1, "steps": 800}, False),
    "raw-kl0.02-s800": ({"kl_coef": 0.02, "steps": 800}, False),
}
FAR = "raw-kl0.02-s800"

SETTINGS = {
    "base": {},
    "sharp": {"demo_noise": 0.5},        # a more accurate demonstrator: a lower-entropy reference
    "noconf": {"demo_confusion": 0.0},   # wrong positions uniform, not another attribute's answer
    "sft12": {"sft_epochs": 12},         # the reference trained longer on the same demonstrations
    "crowd": {"crowd_noise": 0.3},       # noisier crowd labels: a weaker reward model
}
"""World settings (`--setting NAME:SEED`): bench-scale WorldConfig overrides spanning the reference's
entropy and the crowd's noise."""


def fresh_prompts(per_family: int, seed: int, prefix: str = "fresh") -> list[dict]:
    """Prompts as the world builder draws them: per family, every attribute uniform."""
    rng = np.random.default_rng(seed)
    return [{"id": f"{prefix}-{f}-{i:04d}", "family": f, "attrs": [int(a) for a in rng.integers(0, V.N_VAL, V.N_ATTR)]}
            for f in V.FAMILIES for i in range(per_family)]


@torch.no_grad()
def expert_set(world: str, size: int, oracle: Oracle, reference: M.Policy, rep: int = 0) -> list[dict]:
    """The world's expert set resized to `size` rows per family (a seeded subset, or extra rows drawn
    and labelled as the builder does); replicate `rep` > 0 is a whole new set drawn that way."""
    gold = D.read_jsonl(os.path.join(world, "data", "gold_calib.jsonl"), labelled=True)
    by_family = D.group_by_family(gold)
    have = min(len(v) for v in by_family.values())
    if rep > 0:
        gold, have = [], 0
    if 0 < size <= have:
        rng = np.random.default_rng(size)
        return [r for f in V.FAMILIES for r in [by_family[f][i] for i in sorted(rng.permutation(len(by_family[f]))[:size])]]
    manifest = json.load(open(os.path.join(world, "manifest.json")))
    noise = manifest["config"]["gold_noise"]
    # sets drawn afresh are seeded by the world too (from draw 800 on): with the same prompts and random
    # numbers in every world, the worlds' coverages shared one set's luck and were not separate evidence
    salt = 7919 * manifest["seed"] if rep >= 800 else 0
    extra = fresh_prompts(size - have, 50_000 + 1000 * rep + size + salt, prefix=f"gold-extra{rep}")
    gen = torch.Generator().manual_seed(1000 * rep + size + salt)
    prompts = D.prompts_tensor(extra)
    responses = rollout.sample(reference, prompts, 1, 1.0, gen)
    labels = oracle.true_quality(prompts, responses) + noise * torch.randn(len(extra), generator=gen)
    return gold + [dict(r, response=V.decode_response(y), label=round(float(lab), 4))
                   for r, y, lab in zip(extra, responses.tolist(), labels.tolist())]


def setting_of(world: str, reference: M.Policy) -> dict:
    """The world's knobs that matter here, and its reference's entropy per response token."""
    m = json.load(open(os.path.join(world, "manifest.json")))
    c = m["config"]
    prompts = D.prompts_tensor(fresh_prompts(100, 7)).repeat_interleave(4, 0)
    with torch.no_grad():
        ys = rollout.sample(reference, prompts[::4], 4, 1.0, torch.Generator().manual_seed(0))
        ent = float(M.entropy(reference, prompts, ys).mean())
    return {"world": m["world_hash"], "seed": m["seed"], "sft_epochs": c["sft_epochs"],
            "demo_confusion": c["demo_confusion"], "demo_noise": c["demo_noise"], "crowd_noise": c["crowd_noise"], "entropy": round(ent, 2)}


def trained_policies(world: str, work: str, names: list[str], steps_scale: float, seed: int) -> tuple[dict, str, dict]:
    """{name: dir} (reference included), the correction wrapper path and the diagnostic, all cached."""
    os.makedirs(work, exist_ok=True)
    j = lambda *p: os.path.join(world, *p)  # noqa: E731
    diag_path, wrapper = os.path.join(work, "diag.json"), os.path.join(work, "correction.py")
    if not os.path.isfile(diag_path):
        diag = run_diagnostic(j("reward_model"), j("policy"), j("data", "prompts_train.jsonl"))
        with open(diag_path, "w") as f:
            json.dump(diag, f)
    diag = json.load(open(diag_path))
    if not os.path.isfile(wrapper):
        write_wrapper(fit_corrections(diag, D.read_jsonl(j("reward_model", "train.jsonl"), labelled=True)), wrapper)
    paths = {"reference": j("policy")}
    for name in names:
        out = os.path.join(work, name)
        if not os.path.isfile(os.path.join(out, "config.json")):
            ov, corrected = POLICIES[name]
            ov = dict(ov, steps=max(1, int(ov["steps"] * steps_scale)), seed=seed)
            if corrected:
                ov["reward_wrapper"] = wrapper
            t = time.perf_counter()
            M.save_policy(train_rl(load_rl_config(j("configs", "default.json"), ov)).policy, M.default_config(), out)
            print(f"  trained {name} in {time.perf_counter() - t:.0f}s", flush=True)
        paths[name] = out
    return paths, wrapper, diag


def policy_labels(world: str, policy: M.Policy, gold: list[dict], k: int, seed: int = 0, cell: str = "") -> dict[str, list[dict]]:
    """K expert labels per family on the policy's own samples (label_requests' draw, the world's
    annotator). Each (world, policy, expert set, label seed) `cell` gets its own sampling stream and
    request ids (the annotator seeds its noise by id): with one seed for all, every policy of every world
    was asked with the same random numbers and given the same noise, and the coverage cells were few
    independent draws counted many times."""
    if k <= 0:
        return {}
    tag = f"{cell}:{seed}"
    stream = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:4], "little")
    return D.group_by_family(label_requests(WorldPaths.at(world), draw_requests(policy, gold, k, seed=stream,
                                                                               prefix=f"req-{tag}")))


def evaluate_world(world: str, a: argparse.Namespace) -> list[dict]:
    oracle, cfg = Oracle(world), replace(C.CertifyConfig(), ess_widening=a.ess_widening)
    reference = M.load_policy(os.path.join(world, "policy"))[0]
    setting = setting_of(world, reference)
    print(f"world {setting}", flush=True)
    paths, wrapper_path, _ = trained_policies(world, os.path.join(a.work, setting["world"]), a.policies,
                                              a.steps_scale, setting["seed"])
    rm, wrapper = R.load_rm(os.path.join(world, "reward_model"))[0], load_wrapper(wrapper_path)
    deploy = fresh_prompts(a.truth_prompts, 10_000 + setting["seed"], prefix="deploy")
    rows = []
    for name, path in paths.items():
        policy = M.load_policy(path)[0]
        truth = oracle.grade_policy(policy, deploy, n=8, seed=1)
        for size, gold_rep in [(size, a.draw_offset + r) for size in a.gold_sizes for r in range(a.gold_reps)]:
            t = time.perf_counter()
            gold = expert_set(world, size, oracle, reference, gold_rep)
            xp = oracle.grade_policy(policy, [{k: r[k] for k in ("id", "family", "attrs")} for r in gold], n=8)
            gen = torch.Generator().manual_seed(cfg.seed)
            evidence = {f: family_evidence(policy, reference, rm, wrapper, g, cfg, [], gen)
                        for f, g in D.group_by_family(gold).items()}
            bare = certified(evidence, {}, rm, wrapper, replace(cfg, ess_widening=0.0, family_correlation=0.0))  # before #19
            off = certified(evidence, {}, rm, wrapper, cfg)
            for k, label_seed in [(k, a.draw_offset + s) for k in a.policy_labels for s in range(a.label_seeds if k else 1)]:
                labels = policy_labels(world, policy, gold, k, label_seed, f"{setting['world']}/{name}/{size}/{gold_rep}")
                rep = certified(evidence, labels, rm, wrapper, cfg)
                cell = {**setting, "gold": size, "gold_rep": gold_rep, "K": k, "label_seed": label_seed, "policy": name}
                for f, r in rep.items():
                    rows.append({**cell, "method": "ours", "family": f,
                                 "truth": truth[f"truth/{f}"], "truth_xp": xp[f"truth/{f}"],
                                 "certifiable": r["certifiable"], "estimate": r["estimate"], "lo": r["lo"],
                                 "hi": r["hi"], "lo0": bare[f]["lo"], "hi0": bare[f]["hi"],
                                 "evidence": r.get("evidence", "expert set")})
                if k:
                    scored = labelled_scores(rm, wrapper, labels)
                    arrays = {f: C.label_arrays(off[f], evidence[f], labels[f], scored[f], cfg) for f in labels}
                    rows += reference_rows(cell, arrays, truth, xp, cfg.level, a.ppi_py)
                    if a.arrays is not None:
                        ours_arrays = {f: C.predictor_arrays(off[f], evidence[f], labels[f], scored[f], cfg)
                                       for f in labels}
                        a.arrays.append({**cell, "truth": truth, "truth_xp": xp, "off": off, "arrays": arrays,
                                         "ours_arrays": ours_arrays,
                                         "evidence": {f: {key: evidence[f][key] for key in KEPT} for f in evidence}})
                show(setting["seed"], size, k, name, truth, rep["balanced"], time.perf_counter() - t)
    return rows


def certified(evidence: dict, labelled: dict, rm, wrapper, cfg: C.CertifyConfig) -> dict:
    """{family: row, "balanced": row} as certify reports them, from evidence already drawn."""
    rows, draws, ref_draws = C.estimate_families(evidence, labelled, labelled_scores(rm, wrapper, labelled), cfg)
    return {**rows, "balanced": C.aggregate(rows, draws, ref_draws, {f: 1.0 for f in V.FAMILIES}, cfg)}


def show(seed, size, k, name, truth, b, secs) -> None:
    shown = f"{b['estimate']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}]" if b["certifiable"] else f"refused ({b['reason'][:60]})"
    print(f"  world {seed} gold {size} K {k:3d} {name:22s} truth {truth['truth/balanced']:.3f}  certified {shown}"
          f"  ({secs:.0f}s)", flush=True)


def summarise(rows: list[dict]) -> dict:
    out = {}
    for level, keep in (("family", lambda r: r["family"] != "balanced"), ("balanced", lambda r: r["family"] == "balanced")):
        sel = [r for r in rows if keep(r)]
        given = [r for r in sel if r["certifiable"]]
        bare, nan = [r for r in given if r["K"] == 0], float("nan")  # the interval before #19, off-policy only
        err = np.array([r["estimate"] - r["truth"] for r in given])
        cover = lambda key: float(np.mean([r["lo"] <= r[key] <= r["hi"] for r in given])) if given else float("nan")  # noqa: E731
        out[level] = {"n": len(sel), "given": len(given), "refusal_rate": 1 - len(given) / max(len(sel), 1),
                      "mae": float(np.abs(err).mean()) if len(err) else float("nan"),
                      "bias": float(err.mean()) if len(err) else float("nan"),
                      "coverage": cover("truth"), "cover_xp": cover("truth_xp"),
                      "cover_bare": float(np.mean([r["lo0"] <= r["truth"] <= r["hi0"] for r in bare])) if bare else nan,
                      "width_bare": float(np.mean([r["hi0"] - r["lo0"] for r in bare])) if bare else nan,
                      "width": float(np.mean([r["hi"] - r["lo"] for r in given])) if given else float("nan")}
    return out


def set_interval(rows: list[dict], level: float = 0.90, draws: int = 2000) -> tuple[float, float]:
    """A bootstrap interval of the coverage over expert sets: one set's errors are shared by every
    policy and family certified from it, so the set, not the interval, is the independent unit."""
    by_set: dict = {}
    for r in rows:
        if r["certifiable"]:
            by_set.setdefault((r["gold"], r["gold_rep"]), []).append(r["lo"] <= r["truth"] <= r["hi"])
    if len(by_set) < 2:
        return float("nan"), float("nan")
    hits = np.array([sum(v) for v in by_set.values()], float)
    n = np.array([len(v) for v in by_set.values()], float)
    idx = np.random.default_rng(0).integers(0, len(hits), (draws, len(hits)))
    cov = hits[idx].sum(1) / n[idx].sum(1)
    return float(np.quantile(cov, (1 - level) / 2)), float(np.quantile(cov, (1 + level) / 2))


def _key(r: dict) -> tuple:
    return (r["world"], r["policy"], r["gold"], r["gold_rep"], r["K"], r["label_seed"], r["family"])


def width_ratio(rows: list[dict], k: int, level: str = "family") -> float:
    """Mean width of ours over mean width of ppi_py's, on the cells both certified at K."""
    keep = lambda r: r["K"] == k and r["certifiable"] and (r["family"] == "balanced") == (level == "balanced")  # noqa: E731
    ppi = {_key(r): r["hi"] - r["lo"] for r in rows if keep(r) and r.get("method") == "ppi_py"}
    ours = {_key(r): r["hi"] - r["lo"] for r in rows if keep(r) and r.get("method", "ours") == "ours" and _key(r) in ppi}
    return float(np.mean(list(ours.values())) / np.mean([ppi[c] for c in ours])) if ours else float("nan")


def report(rows: list[dict], ks: list[int]) -> dict:
    """Prints the tables; returns {(method, K): (min over settings, pooled) family-level deployment coverage}."""
    settings = sorted({(r["world"], r["seed"], r["entropy"], r["crowd_noise"], r["gold"]) for r in rows},
                      key=lambda s: (s[1], s[4]))
    methods = [m for m in ("ours", "ppi_py", "classical") if any(r.get("method", "ours") == m for r in rows)]
    worst = {}
    print(f"\n{'seed':>4s} {'H/tok':>5s} {'crowd':>5s} {'gold':>4s} {'K':>3s} {'method':9s} {'level':8s} {'cells':>5s} "
          f"{'given':>5s} {'MAE':>6s} {'bias':>7s} {'cover':>6s} {'cov_xp':>6s} {'width':>6s} {'bare':>6s} {'w_bare':>6s} "
          f"{'cover, 90% over sets':>20s}")
    for k in ks:
        for m in methods:
            for w, seed, ent, crowd, gold in settings:
                sel = [r for r in rows if r["world"] == w and r["gold"] == gold and r["K"] == k and r.get("method", "ours") == m]
                if not sel:
                    continue
                s = summarise(sel)
                worst[m, k] = min(worst.get((m, k), 1.0), s["family"]["coverage"])
                for level, v in s.items():
                    lo, hi = set_interval([r for r in sel if (r["family"] == "balanced") == (level == "balanced")])
                    print(f"{seed:4d} {ent:5.2f} {crowd:5.2f} {gold:4d} {k:3d} {m:9s} {level:8s} {v['n']:5d} {v['given']:5d} "
                          f"{v['mae']:6.3f} {v['bias']:+7.3f} {v['coverage']:6.3f} {v['cover_xp']:6.3f} {v['width']:6.3f} "
                          f"{v['cover_bare']:6.3f} {v['width_bare']:6.3f}       [{lo:.3f}, {hi:.3f}]")
    print()
    for k in ks:
        for m in methods:
            sel = [r for r in rows if r["K"] == k and r.get("method", "ours") == m]
            if not sel:
                continue
            s = summarise(sel)
            far = [r for r in sel if r["policy"] == FAR and r["family"] == "balanced"]
            worst[m, k] = (worst[m, k], s["family"]["coverage"])
            print(f"all settings, K {k:3d}, {m:9s}: family coverage {s['family']['coverage']:.3f} (min over settings "
                  f"{worst[m, k][0]:.3f}; {s['family']['given']}/{s['family']['n']} certified, MAE {s['family']['mae']:.3f}, "
                  f"width {s['family']['width']:.3f}); balanced {s['balanced']['coverage']:.3f} "
                  f"({s['balanced']['given']}/{s['balanced']['n']}, width {s['balanced']['width']:.3f}); "
                  f"far policy certified in {sum(r['certifiable'] for r in far)}/{len(far)}")
        if k and "ppi_py" in methods:
            print(f"K {k:3d}: width ours / ppi_py on the same cells: family {width_ratio(rows, k):.3f}, "
                  f"balanced {width_ratio(rows, k, 'balanced'):.3f}")
    return worst


def last_lines(rows: list[dict], worst: dict) -> None:
    """The summary lines: deployment_coverage (off-policy, K = 0, min over settings), labelled_coverage
    (K = 50, min over settings), then coverage_k20 (ours, family level, pooled over settings) and the width
    ratios against ppi_py."""
    if ("ours", 0) in worst:
        print(f"deployment_coverage: {worst['ours', 0][0]:.3f}")
    if ("ours", 50) in worst:
        print(f"labelled_coverage: {worst['ours', 50][0]:.3f}")
    if ("ours", 20) in worst:
        print(f"coverage_k20: {worst['ours', 20][1]:.3f}")
    for k in (20, 50):
        if ("ppi_py", k) in worst:
            print(f"width_ratio_vs_ppi_k{k}: {width_ratio(rows, k):.3f}")


def parse_setting(ap: argparse.ArgumentParser, text: str) -> tuple[str, int]:
    name, _, seed = text.partition(":")
    if name not in SETTINGS or not seed.strip().isdigit():
        ap.error(f"--setting {text!r}: expected NAME:SEED with NAME one of {', '.join(SETTINGS)}")
    return name, int(seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", action="append", default=[], help="an already built world (repeatable)")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME:SEED",
                    help=f"a bench world of a setting ({', '.join(SETTINGS)}) and seed, built once (repeatable)")
    ap.add_argument("--worlds", type=int, default=5,
                    help="without --world or --setting: how many base bench worlds to build")
    ap.add_argument("--seed", type=int, default=300, help="without --world: the first world seed")
    ap.add_argument("--cache", default="worlds/bench")
    ap.add_argument("--work", default="outputs/certify_accuracy")
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of the trained policies")
    ap.add_argument("--gold-sizes", default="100", help="expert rows per family, comma-separated")
    ap.add_argument("--policy-labels", default="0", help="K expert labels per family on the policy's samples")
    ap.add_argument("--gold-reps", type=int, default=1,
                    help="expert sets per size: the world's, then sets drawn afresh as the builder draws them (one "
                         "set's errors are shared by every policy, so coverage needs several)")
    ap.add_argument("--label-seeds", type=int, default=1,
                    help="label-request draws per K and expert set, each with its own sampling stream and noise")
    ap.add_argument("--draw-offset", type=int, default=0,
                    help="number the expert sets and label draws from here (> 0: every expert set drawn afresh, "
                         "none the world's own): draws no earlier run has seen, to check constants chosen on those")
    ap.add_argument("--truth-prompts", type=int, default=1000,
                    help="fresh prompts per family for the truth (8 samples each; its own SE about 0.002)")
    ap.add_argument("--ess-widening", type=float, default=C.CertifyConfig().ess_widening)
    ap.add_argument("--out", help="write every cell as JSON here")
    ap.add_argument("--no-ppi-py", dest="ppi_py", action="store_false",
                    help="leave out ppi_py's PPI++ beside ours (it needs the bench extra: pip install -e '.[bench]')")
    ap.add_argument("--arrays", dest="arrays_path", metavar="F",
                    help="pickle every labelled cell's predictor arrays, labels, off-policy rows and evidence here "
                         "(to try estimators offline)")
    ap.add_argument("--from-arrays", action="append", default=[], metavar="F",
                    help="re-estimate the labelled cells kept with --arrays (repeatable; pooled) with the estimator as "
                         "the code now computes it, computing nothing else")
    ap.add_argument("--cells", action="append", default=[], metavar="F",
                    help="report the cells an earlier run wrote with --out (repeatable; pooled), computing nothing")
    a = ap.parse_args()
    a.policies = [p for p in a.policies.split(",") if p]
    a.arrays = [] if a.arrays_path else None
    if a.ppi_py and not a.cells:  # --from-arrays needs it too
        try:
            import ppi_py  # noqa: F401
        except ImportError:
            ap.error(INSTALL)
    unknown = [p for p in a.policies if p not in POLICIES]
    if unknown:
        ap.error(f"--policies: unknown {', '.join(unknown)} (choose from {', '.join(POLICIES)}; the reference is "
                 "always included)")
    a.setting = [parse_setting(ap, x) for x in a.setting]
    a.gold_sizes = [int(x) for x in a.gold_sizes.split(",")]
    a.policy_labels = sorted({0} | {int(x) for x in a.policy_labels.split(",")})
    if a.cells or a.from_arrays:
        rows = [r for path in a.cells for r in json.load(open(path))]
        rows += recompute([c for path in a.from_arrays for c in pickle.load(open(path, "rb"))], C.CertifyConfig(),
                          a.ppi_py)
        ks = sorted({r["K"] for r in rows})
        last_lines(rows, report(rows, ks))
        return
    configure_threads()
    t0 = time.perf_counter()
    worlds = list(a.world) + [ensure_world(a.cache, seed, None, "bench", progress=print, **SETTINGS[name])[0]
                              for name, seed in a.setting]
    if not worlds:
        worlds = [ensure_world(a.cache, s, None, "bench", progress=print)[0] for s in range(a.seed, a.seed + a.worlds)]
    rows = []
    for w in worlds:  # written after every world: a long run's finished worlds survive it
        rows += evaluate_world(w, a)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f)
        if a.arrays is not None:
            with open(a.arrays_path, "wb") as f:
                pickle.dump(a.arrays, f)
    worst = report(rows, a.policy_labels)
    print(f"total {time.perf_counter() - t0:.0f}s")
    last_lines(rows, worst)


if __name__ == "__main__":
    main()
