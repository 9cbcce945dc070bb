"""Certifying a policy trained elsewhere from a table of its samples (issue 46): does each family's
interval cover the truth, and how wide is it against ppi_py on the same arrays?

    python benchmarks/external_policy.py --world W [--steps 800] [--draws 10] [--ks 20,50] [--per-prompt 8]
        [--work /tmp/external_policy_bench] [--out cells.json]

The policy is examples/external_policy's: trained once by its own script (its own REINFORCE and model
code, on W's reward model from W's reference) and cached under --work. Each draw d (d = 0..draws-1) is
the loop its README runs, with every random part fresh: the example's export with seed d (its samples,
`--per-prompt` on each expert-set prompt, scored by its own reward-model code, with its log-probs; the
expert set with its numbers), label requests drawn from the table with seed d (`label-requests
--samples`: decisions/label_requests.draw_table_requests), the world's synthetic expert
(world/annotator.py: truth + the expert set's noise), then certify_table (what `certify-table` computes).
On the same arrays as certify_table's labelled estimate (the calibrated scores of the labelled rows and
of the unlabelled rows, the labels) ppi_py's PPI++ (`ppi_py.ppi_mean_ci`, benchmarks/ppi_reference.py)
and the labels' own t interval.

Two table layouts from the same export and the same labels:
- `plain`: the table as exported, as the README's loop certifies it. Its labels are rows of the table,
  so a labelled prompt keeps per_prompt - 1 unlabelled samples and the others per_prompt;
- `extra` (a diagnostic): each prompt's first sample, the one the request draw picks, is kept only where
  it was labelled: every prompt has per_prompt - 1 unlabelled samples and the labelled responses are
  samples of their own, certify's own layout (tests/test_certify_table.py's export).

Truth (the oracle, world/oracle.py): the mean true quality of the policy's samples per family, on
`--truth-prompts` fresh prompts per family drawn as the world builder draws them (8 samples each: the
deployment truth, what the interval is about), and on the expert set's own prompts (64 samples each).
Prints, per layout, K and method, coverage of both truths over the (family, draw) cells, mean width and
MAE; ours' mean width over ppi_py's on the same cells; the last lines `coverage_k<K>` and
`width_ratio_vs_ppi_k<K>` are the plain layout's. Needs the bench extra (`pip install -e '.[bench]'`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlhf_mlflow.core import tables as TB  # noqa: E402
from rlhf_mlflow.core import vocab as V  # noqa: E402
from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.decisions.certify import CertifyConfig  # noqa: E402
from rlhf_mlflow.decisions.label_requests import draw_table_requests  # noqa: E402
from rlhf_mlflow.decisions.policy_labels import label_arrays  # noqa: E402
from rlhf_mlflow.decisions.table_certify import certify_table, family_arrays  # noqa: E402
from rlhf_mlflow.world.annotator import label_requests  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402

from benchmarks.ppi_reference import INSTALL, classical_interval, ppi_py_interval  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "external_policy")
LAYOUTS = ("plain", "extra")
METHODS = ("ours", "ppi_py", "classical")


def example(name: str):
    """A module of the example (it imports its siblings by name: its folder goes on the path)."""
    if EXAMPLE not in sys.path:
        sys.path.insert(0, EXAMPLE)
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def trained(world: str, work: str, steps: int, kl_coef: float) -> str:
    """The example's checkpoint, trained by its own script once per (world, steps, kl_coef)."""
    ckpt = os.path.join(work, f"ckpt-s{steps}-kl{kl_coef:g}")
    meta = os.path.join(ckpt, "meta.json")
    if not (os.path.isfile(meta) and json.load(open(meta))["training"]["world"] == world):
        t = time.perf_counter()
        subprocess.run([sys.executable, os.path.join(EXAMPLE, "train.py"), "--world", world, "--steps", str(steps),
                        "--kl-coef", str(kl_coef), "--log-every", "100", "--out", ckpt], check=True)
        print(f"trained the example's policy in {time.perf_counter() - t:.0f}s", flush=True)
    return ckpt


@torch.no_grad()
def truth(world: str, ckpt: str, per_family: int) -> dict:
    """{"deploy": {family: truth}, "expert": {family: truth}}, cached beside the checkpoint."""
    path = os.path.join(ckpt, f"truth-{per_family}.json")
    if os.path.isfile(path):
        return json.load(open(path))
    tinylm, oracle = example("tinylm"), Oracle(world)
    policy = tinylm.load_checkpoint(ckpt)[0]
    rng = np.random.default_rng(10_000)
    fresh = [(f, [int(a) for a in rng.integers(0, V.N_VAL, V.N_ATTR)]) for f in V.FAMILIES for _ in range(per_family)]
    gold = [(g["family"], g["attrs"]) for g in tinylm.load_world(world)[3]]
    out = {}
    for name, prompts, n in (("deploy", fresh, 8), ("expert", gold, 64)):
        q, fam = [], []
        gen = torch.Generator().manual_seed(1)
        chunk = 4096 // n  # prompts per batch: 4,096 responses
        for i in range(0, len(prompts), chunk):
            part = torch.tensor([tinylm.prompt_ids(f, a) for f, a in prompts[i:i + chunk]])
            y = policy.sample(part, n, gen) + tinylm.FIRST_CONTENT
            q.append(oracle.true_quality(part.repeat_interleave(n, 0), y))
            fam += [f for f, _ in prompts[i:i + chunk] for _ in range(n)]
        q, fam = torch.cat(q).numpy(), np.array(fam)
        out[name] = {f: float(q[fam == f].mean()) for f in V.FAMILIES}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def export_draw(world: str, ckpt: str, per_prompt: int, d: int, work: str) -> tuple[str, str]:
    """The example's export with seed d: (samples path, expert-set path)."""
    out = os.path.join(work, f"draw{d}")
    paths = os.path.join(out, "samples.jsonl"), os.path.join(out, "expert_set.jsonl")
    if not all(os.path.isfile(p) for p in paths):
        exp = example("export")
        samples, expert = exp.export(world, ckpt, per_prompt, d)
        os.makedirs(out, exist_ok=True)
        exp.write_jsonl(paths[0], samples)
        exp.write_jsonl(paths[1], expert)
    return paths


def layouts(samples: list[dict], labels: dict[str, float]) -> dict[str, list[dict]]:
    """The plain table, and `extra`: each prompt's first row dropped where it was not labelled."""
    first = {}
    for r in samples:
        first.setdefault(r["prompt_key"], r["id"])
    drop = {i for i in first.values() if i not in labels}
    return {"plain": samples, "extra": [r for r in samples if r["id"] not in drop]}


def cells(rows: list[dict], labels: dict, expert: list[dict], cfg: CertifyConfig, level: float) -> dict:
    """{family: {method: (estimate, lo, hi) or None}, with the evidence ours used}."""
    report = certify_table(rows, labels, expert, cfg)
    out = {}
    for f in V.FAMILIES:
        mine = [r for r in rows if r["family"] == f]
        row = report["families"][f]
        ev, labelled = family_arrays(mine, labels, [r for r in expert if r["family"] == f], [], cfg)
        f_unl, f_lab, y, _ = label_arrays(row, ev, labelled, np.array([r["score"] for r in labelled]), cfg)
        flat = np.concatenate([np.ravel(a) for a in f_unl])
        out[f] = {"ours": (row["estimate"], row["lo"], row["hi"]) if row["certifiable"] else None,
                  "ppi_py": ppi_py_interval(y, f_lab, flat, level), "classical": classical_interval(y, level),
                  "evidence": row.get("evidence") or row.get("reason"),
                  "predictor": (row.get("ppi") or {}).get("predictor")}
    return out


def run(a: argparse.Namespace) -> list[dict]:
    world = os.path.abspath(a.world)
    os.makedirs(a.work, exist_ok=True)
    ckpt = trained(world, a.work, a.steps, a.kl_coef)
    truths = truth(world, ckpt, a.truth_prompts)
    print("truth (deployment):", {f: round(v, 3) for f, v in truths["deploy"].items()}, flush=True)
    cfg, out = CertifyConfig(), []
    for d in range(a.draws):
        t = time.perf_counter()
        samples_path, expert_path = export_draw(world, ckpt, a.per_prompt, d, a.work)
        samples, expert = TB.read_samples(samples_path), TB.read_expert_set(expert_path)
        for k in a.ks:
            requests = draw_table_requests(samples, k, None, seed=d)
            labels = {r["id"]: r["label"] for r in label_requests(WorldPaths.at(world), requests)}
            for layout, rows in layouts(samples, labels).items():
                if layout not in a.layouts:
                    continue
                for f, c in cells(rows, labels, expert, cfg, cfg.level).items():
                    for m in METHODS:
                        est = c[m]
                        out.append({"draw": d, "K": k, "layout": layout, "family": f, "method": m,
                                    "certified": est is not None, "estimate": est and est[0],
                                    "lo": est and est[1], "hi": est and est[2], "truth": truths["deploy"][f],
                                    "truth_xp": truths["expert"][f], "evidence": c["evidence"] if m == "ours" else m,
                                    "predictor": c["predictor"] if m == "ours" else None})
        print(f"draw {d}: {time.perf_counter() - t:.0f}s", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f)
    return out


def summary(sel: list[dict]) -> dict:
    given = [r for r in sel if r["certified"]]
    cover = lambda key: float(np.mean([r["lo"] <= r[key] <= r["hi"] for r in given])) if given else float("nan")  # noqa: E731
    return {"cells": len(sel), "certified": len(given), "coverage": cover("truth"), "cover_xp": cover("truth_xp"),
            "width": float(np.mean([r["hi"] - r["lo"] for r in given])) if given else float("nan"),
            "mae": float(np.mean([abs(r["estimate"] - r["truth"]) for r in given])) if given else float("nan")}


def ratio(rows: list[dict], **where) -> tuple[float, int]:
    """Ours' mean width over ppi_py's on the cells ours certified (and the number of cells)."""
    key = lambda r: (r["draw"], r["K"], r["layout"], r["family"])  # noqa: E731
    pick = [r for r in rows if all(r[k] == v for k, v in where.items()) and r["certified"]]
    ppi = {key(r): r["hi"] - r["lo"] for r in pick if r["method"] == "ppi_py"}
    ours = [(r["hi"] - r["lo"], ppi[key(r)]) for r in pick if r["method"] == "ours" and key(r) in ppi]
    return (float(np.mean([o for o, _ in ours]) / np.mean([p for _, p in ours])) if ours else float("nan")), len(ours)


def report(rows: list[dict]) -> None:
    print(f"\n{'layout':7s} {'K':>3s} {'method':9s} {'cells':>5s} {'cert':>5s} {'cover':>6s} {'cov_xp':>6s} "
          f"{'width':>6s} {'MAE':>6s}  ours/ppi_py")
    for layout in LAYOUTS:
        for k in sorted({r["K"] for r in rows}):
            for m in METHODS:
                sel = [r for r in rows if r["layout"] == layout and r["K"] == k and r["method"] == m]
                if not sel:
                    continue
                s = summary(sel)
                rat = f"{ratio(rows, layout=layout, K=k)[0]:.3f}" if m == "ours" else ""
                print(f"{layout:7s} {k:3d} {m:9s} {s['cells']:5d} {s['certified']:5d} {s['coverage']:6.3f} "
                      f"{s['cover_xp']:6.3f} {s['width']:6.3f} {s['mae']:6.3f}  {rat}")
            kinds = sorted({r["evidence"].split(" (")[0] for r in rows if r["method"] == "ours" and r["layout"] == layout
                            and r["K"] == k and r["certified"]})
            for kind in kinds:
                sel = [r for r in rows if r["layout"] == layout and r["K"] == k and r["method"] == "ours"
                       and r["certified"] and r["evidence"].startswith(kind)]
                s, (rat, n) = summary(sel), ratio([r for r in rows if r["method"] != "ours" or r in sel], layout=layout, K=k)
                preds = sorted({str(r["predictor"]) for r in sel})
                print(f"{'':7s} {'':3s}   ours, {kind}: {n} cells, cover {s['coverage']:.3f}, width {s['width']:.3f}, "
                      f"ours/ppi_py {rat:.3f}; predictor: {'; '.join(preds)}")
    print()
    for k in sorted({r["K"] for r in rows}):
        s = summary([r for r in rows if r["layout"] == "plain" and r["K"] == k and r["method"] == "ours"])
        print(f"coverage_k{k}: {s['coverage']:.3f}")
        print(f"width_ratio_vs_ppi_k{k}: {ratio(rows, layout='plain', K=k)[0]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", help="a built world (rlhf-mlflow build-world --seed 0 --spec default --out W)")
    ap.add_argument("--steps", type=int, default=800, help="the example's training steps")
    ap.add_argument("--kl-coef", type=float, default=0.1)
    ap.add_argument("--draws", type=int, default=10, help="label draws, each on a fresh export")
    ap.add_argument("--ks", default="20,50", help="labels per family")
    ap.add_argument("--per-prompt", type=int, default=8, help="samples per expert-set prompt in each export")
    ap.add_argument("--truth-prompts", type=int, default=1000, help="fresh prompts per family for the truth")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--work", default="/tmp/external_policy_bench", help="checkpoint, truth and exports, reused")
    ap.add_argument("--out", help="write every cell as JSON here")
    ap.add_argument("--cells", help="report the cells an earlier --out wrote, computing nothing")
    a = ap.parse_args()
    a.ks, a.layouts = [int(k) for k in a.ks.split(",")], a.layouts.split(",")
    if a.cells:
        report(json.load(open(a.cells)))
        return
    if not a.world:
        ap.error("--world is required (or --cells)")
    try:
        import ppi_py  # noqa: F401
    except ImportError:
        ap.error(INSTALL)
    configure_threads()
    t = time.perf_counter()
    rows = run(a)
    report(rows)
    print(f"total {time.perf_counter() - t:.0f}s")


if __name__ == "__main__":
    main()
