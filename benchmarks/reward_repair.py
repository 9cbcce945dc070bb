"""Does repairing the reward model with expert labels close the gap to the ceiling? Truth per round and
per method, on worlds of different corruption settings (a benchmark may read the truth: it grades and
plays the expert; repair, diagnostic and correction never read it).

    python benchmarks/reward_repair.py [--worlds SEED:SPEC ...] [--rounds 3] [--per-family 40]
                                       [--repeats 1] [--methods none repair] [--out DIR]

Per world (built once, `worlds/<hash>`; SPEC is default, clean or a spec file):
  - ceiling: corrected-kl005-s1200's recipe on the oracle's true reward;
  - round 0: the recipe on the world's reward model minus the diagnostic's correction (main's champion
    recipe), graded by the oracle;
  - `repair`, each round r: --per-family expert labels per family on the last policy's own responses
    (expert-set prompts, training/../label_requests' draw), the reward model repaired with every label so
    far (training/repair_rm.py as repair_rm runs it: the world's own model fine-tuned with anchors; stops
    where the gate, decisions/rm_gate.py, refuses it), the repaired model audited and corrected
    (diagnostic -> correction), the recipe trained on it and graded;
  - `none`: no repair (round 0's policy, retrained with another seed each round: the run-to-run spread);
  - `ensemble`: no labels bought; --members reward models fine-tuned from the world's on bootstraps of the
    repair's data without bought labels (the crowd minus its premiums, the anchors, the expert set), each
    with a new head (training/rm_ensemble.py); the recipe trained on their mean - --penalty x spread, with
    the correction fitted on member 0 (one round: nothing changes between rounds);
  - `both`: `repair`, and each round the ensemble on that round's data sharing the repaired model's label
    head (core/reward_ensemble.py), the recipe trained on its mean - --penalty x spread with the repaired
    model's correction.
Results per (world, method, repeat) go to --out as JSON (kept: a rerun skips them). Last lines:
`ceiling_fraction: X` (median over worlds of the best method's best round's truth / ceiling) and
`labels_per_point: Y` (the best label-buying method's labels, spent by its best round, per 0.01 of truth
gained over round 0, median over worlds; `inf` where nothing was gained). `--report` prints them from --out without training anything.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_ensemble as RE  # noqa: E402
from rlhf_mlflow.core import reward_model as R  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.decisions import rm_gate  # noqa: E402
from rlhf_mlflow.decisions.correction import fit_corrections, write_wrapper  # noqa: E402
from rlhf_mlflow.evidence.diagnostic import run_diagnostic  # noqa: E402
from rlhf_mlflow.evidence.label_requests import draw_requests  # noqa: E402
from rlhf_mlflow.training import repair_rm as RR  # noqa: E402
from rlhf_mlflow.training.evaluate import first_per_family  # noqa: E402
from rlhf_mlflow.training.recipes import CORRECTED  # noqa: E402
from rlhf_mlflow.training.rl_config import load_rl_config  # noqa: E402
from rlhf_mlflow.training.rm_ensemble import ensemble_for_repair  # noqa: E402
from rlhf_mlflow.training.train_rl import train_rl  # noqa: E402
from rlhf_mlflow.world import corruptions as C  # noqa: E402
from rlhf_mlflow.world.annotator import label_requests  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle, write_oracle_reward  # noqa: E402

RECIPE = "corrected-kl005-s1200"
LABELLED = ("repair", "both")
"""The methods that buy labels (labels_per_point is theirs)."""


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class WorldRun:
    def __init__(self, world: WorldPaths, work: str, steps_scale: float, members: int = 4, penalty: float = 1.0,
                 head_fit: str = "adaptive"):
        self.world, self.work, self.steps_scale, self.head_fit = world, work, steps_scale, head_fit
        self.members, self.penalty = members, penalty
        self.oracle = Oracle(world.root)
        self.grade_prompts = first_per_family(D.read_jsonl(world.prompts_train))
        self.qa = D.read_jsonl(world.qa, labelled=True)
        self.gold = D.read_jsonl(world.expert_set, labelled=True)
        self.prompts = D.read_jsonl(world.prompts_train)
        os.makedirs(work, exist_ok=True)

    def correction(self, rm_dir: str, tag: str, experts: list[dict] | None = None) -> tuple[str | None, list[dict]]:
        """The diagnostic -> correction of a reward model; `experts`: the labels a repair learned from,
        which credit what they show to be correctness (as repair_rm's audit of its child)."""
        gold = None
        if experts:
            gold = os.path.join(self.work, f"experts-{tag}.jsonl")
            D.write_jsonl(gold, experts)
        diag = run_diagnostic(rm_dir, self.world.policy, self.world.prompts_train, gold_path=gold)
        rules = fit_corrections(diag, self.qa)
        path = os.path.join(self.work, f"correction-{tag}.py")
        write_wrapper(rules, path)
        return (path if rules else None), rules

    def rl(self, rm_dir: str, wrapper: str | None, seed: int, ensemble: str | None = None) -> tuple[M.Policy, float, dict]:
        ov = dict(CORRECTED[RECIPE], reward_model=rm_dir, reward_wrapper=wrapper, seed=seed)
        if ensemble:
            ov.update(reward_ensemble=ensemble, ensemble_penalty=self.penalty)
        ov["steps"] = max(1, int(ov["steps"] * self.steps_scale))
        res = train_rl(load_rl_config(self.world.config, ov))
        truth = self.oracle.grade_policy(res.policy, self.grade_prompts)
        fams = {k[6:]: round(v, 3) for k, v in truth.items()}
        if ensemble:  # the members' disagreement on the policy's last batches
            fams["spread_first"] = round(res.history[0][1]["spread/balanced"], 4)
            fams["spread_last"] = round(res.history[-1][1]["spread/balanced"], 4)
        return res.policy, truth["truth/balanced"], fams

    def ensemble(self, root: str, rules: list[dict], labels: list[dict], tag: str, seed: int,
                 head=None) -> tuple[str, str | None]:
        """Members on the repair's data (root fine-tuned), saved as an ensemble sharing the repaired model's
        label head `head` when given; (its directory, the correction fitted on member 0, or None with a head:
        the repaired model's correction serves)."""
        cfg = RR.RepairConfig(seed=seed, ensemble=self.members)
        anchors = RR.anchor_rows(root, self.world.policy, self.prompts, cfg.anchors, rules, cfg.seed)
        members = ensemble_for_repair(root, self.qa, self.gold + labels, rules, cfg, anchors)
        path = os.path.join(self.work, f"ensemble-{tag}")
        if os.path.exists(path):
            __import__("shutil").rmtree(path)
        RE.save_ensemble(members, R.load_rm(root)[1], path, head=head)
        if head is not None:
            return path, None
        D.write_jsonl(os.path.join(path, "member-0", "train.jsonl"), self.qa)  # the diagnostic audits member 0
        return path, self.correction(os.path.join(path, "member-0"), f"ensemble-{tag}")[0]

    def buy(self, policy: M.Policy, per_family: int, tag: str) -> list[dict]:
        # zlib.crc32, not hash(): str hashes are salted per process, so reruns drew other prompts
        requests = draw_requests(policy, self.gold, per_family, seed=zlib.crc32(tag.encode()) % 10_000,
                                 prefix=f"bench-{tag}")
        return label_requests(self.world, requests)


def run_method(w: WorldRun, method: str, rounds: int, per_family: int, repeat: int, base: dict) -> list[dict]:
    """Round records: round, labels, truth, per-family truth, reward model agreement, refused."""
    out = [{"round": 0, "labels": 0, "truth": base["truth"], "families": base["families"]}]
    policy, root, rules, labels = base["policy"], w.world.reward_model, base["rules"], []
    for r in range(1, rounds + 1):
        if method == "none":
            _, truth, fams = w.rl(root, base["wrapper"], seed=100 * repeat + r)
            out.append({"round": r, "labels": 0, "truth": truth, "families": fams})
            continue
        if method == "ensemble":
            ens, wrapper = w.ensemble(root, rules, [], f"{repeat}", seed=repeat)
            _, truth, fams = w.rl(root, wrapper, seed=100 * repeat + r, ensemble=ens)
            out.append({"round": r, "labels": 0, "truth": truth, "families": fams})
            say(f"  ensemble: truth {truth:.3f}")
            break
        labels += w.buy(policy, per_family, f"{repeat}-r{r}")
        # as repair_rm does: the world's own model, fine-tuned on every label so far, anchored
        cfg = RR.RepairConfig(seed=repeat, head_fit=w.head_fit)
        anchors = RR.anchor_rows(root, w.world.policy, w.prompts, cfg.anchors, rules, cfg.seed)
        rm, info = RR.repair(root, w.qa, w.gold + labels, rules, cfg, anchors=anchors)
        child = os.path.join(w.work, f"rm-{method}-{repeat}-r{r}")
        RR.save_repaired(rm, R.load_rm(root)[1], w.qa, info, child)
        wrapper, child_rules = w.correction(child, f"{method}-{repeat}-r{r}", w.gold + labels)
        gate = rm_gate.evaluate(info["agreement"], rules, child_rules)
        record = {"round": r, "labels": len(labels), "refused": rm_gate.summary(gate) if rm_gate.refused(gate) else "",
                  "agreement": statistics.mean(v["r"] for v in info["agreement"]["child"].values())}
        if rm_gate.refused(gate):
            out.append({**record, "truth": out[-1]["truth"], "families": out[-1]["families"]})
            say(f"  {method} round {r}: repaired model refused ({record['refused']}): the rounds stop")
            break
        ens = None
        if method == "both":  # the members share the repaired model's head, and its correction
            ens, member_wrapper = w.ensemble(root, rules, labels, f"{repeat}-r{r}", seed=repeat, head=rm.label_head)
            wrapper = member_wrapper or wrapper
        policy, truth, fams = w.rl(child, wrapper, seed=100 * repeat + r, ensemble=ens)
        out.append({**record, "truth": truth, "families": fams})
        say(f"  {method} round {r}: {len(labels)} labels, agreement {record['agreement']:.3f}, truth {truth:.3f}")
    return out


def one_world(seed: int, spec_name: str, args) -> dict:
    spec = C.load_spec(spec_name)
    root, manifest = ensure_world(args.cache, seed, spec, args.scale, progress=say)
    h = manifest["world_hash"]
    path = os.path.join(args.out, f"{h}.json")
    if args.report and not os.path.exists(path):
        raise SystemExit(f"--report: no results for world {h} ({spec_name}, seed {seed}) in {args.out}")
    result = json.load(open(path)) if os.path.exists(path) else {"world": h, "seed": seed, "spec": spec_name}
    w = WorldRun(WorldPaths.at(root), os.path.join(args.out, h), args.steps_scale, args.members, args.penalty,
                 args.head_fit)
    if "ceiling" not in result:
        oracle = write_oracle_reward(root, os.path.join(w.work, "oracle_reward.py"))
        result["ceiling"] = w.rl(w.world.reward_model, oracle, seed=0)[1]
        say(f"world {h} ({spec_name}, seed {seed}): ceiling {result['ceiling']:.3f}")
    if args.report:
        return result
    wrapper, rules = w.correction(w.world.reward_model, "r0")
    for repeat in range(args.repeats):
        if all(f"{method}-{repeat}" in result for method in args.methods):
            continue
        key0 = f"round0-{repeat}"
        policy, truth, fams = w.rl(w.world.reward_model, wrapper, seed=100 * repeat)
        result[key0] = {"truth": truth, "families": fams}
        base = {"policy": policy, "truth": truth, "families": fams, "wrapper": wrapper, "rules": rules}
        for method in args.methods:
            key = f"{method}-{repeat}"
            if key in result:
                continue
            say(f"world {h} repeat {repeat}: {method}")
            result[key] = run_method(w, method, args.rounds, args.per_family, repeat, base)
            with open(path + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(path + ".tmp", path)
    return result


def _spread(row: dict) -> str:
    """The ensemble's spread on the policy's first and last logged batches ('' without an ensemble)."""
    fams = row.get("families", {})
    return f"{fams['spread_first']:.3f} -> {fams['spread_last']:.3f}" if "spread_first" in fams else ""


def _table(res: dict, method: str, repeats: int) -> tuple[float, float, float] | None:
    """Print a method's rows on one world; (best round's truth, labels spent by then, round 0's truth),
    medians over repeats, or None where it did not run."""
    finals = []
    for rep in range(repeats):
        rows = res.get(f"{method}-{rep}", [])
        for row in rows:
            print(f"| {method} | {rep} | {row['round']} | {row['labels']} | {row['truth']:.3f} | "
                  f"{row['truth'] / res['ceiling']:.3f} | {row.get('agreement', float('nan')):.3f} | {_spread(row)} | "
                  f"{row.get('refused', '')} |")
        if rows:
            top = max(rows, key=lambda row: row["truth"])
            finals.append((top["truth"], top["labels"], rows[0]["truth"]))
    if not finals:
        return None
    return tuple(statistics.median(f[i] for f in finals) for i in range(3))


def summarise(results: list[dict], methods: list[str], repeats: int) -> tuple[float, float]:
    """Print every world's table; (median best truth / ceiling over worlds, median labels per 0.01 of truth
    gained by the best method that buys labels: inf on a world where none gained)."""
    fractions, per_point = [], []
    for res in results:
        print(f"\nworld {res['world']} ({res['spec']}, seed {res['seed']}): ceiling {res['ceiling']:.3f}")
        print("| method | repeat | round | labels | truth | truth / ceiling | reward model r | ensemble spread | refused |")
        print("|---|---|---|---|---|---|---|---|---|")
        best = {m: b for m in methods if (b := _table(res, m, repeats)) is not None}
        if not best:
            continue
        fractions.append(max(b[0] for b in best.values()) / res["ceiling"])
        labelled = [b for m, b in best.items() if m in LABELLED]
        top = max(labelled, default=None)
        gain = (top[0] - top[2]) * 100 if top else 0.0
        per_point.append(top[1] / gain if gain > 0 else float("inf"))
    return statistics.median(fractions), statistics.median(per_point)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", nargs="+", default=["0:default"], help="SEED:SPEC (default, clean or a spec file)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-family", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=["none", "repair"], choices=["none", "repair", "ensemble", "both"])
    ap.add_argument("--members", type=int, default=4, help="ensemble members (methods ensemble, both)")
    ap.add_argument("--penalty", type=float, default=1.0, help="k in the ensemble's mean - k x spread")
    ap.add_argument("--head-fit", default="adaptive", choices=list(RR.FITS),
                    help="how the repair fits its label head (core/label_head_fit.py)")
    ap.add_argument("--scale", default="full")
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--cache", default="worlds")
    ap.add_argument("--out", default="/tmp/reward_repair")
    ap.add_argument("--report", action="store_true", help="print the tables of the results in --out; train nothing")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    results = []
    for item in args.worlds:
        seed, _, spec = item.partition(":")
        results.append(one_world(int(seed), spec or "default", args))
    fraction, per_point = summarise(results, args.methods, args.repeats)
    print(f"ceiling_fraction: {fraction:.3f}")
    print(f"labels_per_point: {per_point:.1f}")


if __name__ == "__main__":
    main()
