"""Where an RL step's time goes, against how many runs are batched into it: matrix products against the rest.

    python benchmarks/step_composition.py [--batch 1,2,4,8,16] [--steps 20] [--world DIR]

For each N, N policies (the world's reference, seeds 0..N-1) take `--steps` stacked RL steps
(training/batched.stacked_step: sampling, log-probs, the reference, the reward model, backward, Adam) on
one thread, in this thread. Per policy-step it prints the wall milliseconds (timed without the
profiler), the milliseconds inside matrix-product kernels (torch.profiler's self time of addmm, mm, bmm,
baddbmm, in a second, profiled pass) and the rest (wall minus products: elementwise kernels, copies,
reductions, the framework's per-call cost). Then the seed loop's steps/s at two threads, in the same
process (before and after), and what issue #32's targets need of the rest: 3x for one run (N = 1; two
cores give one run --partner-gain over one core, not 2) and 5x for batched runs (N > 1, on two one-thread
workers: 2 x 1000 / ms per policy-step on one core at best).
Last lines: `products_ms_per_policy_step: ...` and `rest_ms_per_policy_step: ...` (one value per N).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import seed_loop  # noqa: E402
from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import rollout  # noqa: E402
from rlhf_mlflow.core.stacked_policy import StackedPolicy  # noqa: E402
from rlhf_mlflow.training.batched import _Joined, stacked_step  # noqa: E402
from rlhf_mlflow.training.rl_config import RLConfig  # noqa: E402
from rlhf_mlflow.training.rl_step import Frozen  # noqa: E402
from rlhf_mlflow.training.stacked_adam import StackedAdam  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402

PRODUCTS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm")
ONE_RUN, BATCHED = 3.0, 5.0  # issue #32: one run, and batched runs, against the seed loop
PARTNER_GAIN = 1.33
"""One run's steps/s with its partner process over one process on one thread (make bench's ours / ours_1p,
2026-12-05: 1.30-1.35): a single run cannot use two cores fully (its step is a chain: sample, score, backward)."""


def shrink(rest: float, products: float, budget: float) -> str:
    """How many times the rest must shrink for products + rest to fit `budget` ms."""
    if budget <= products:
        return f"out of reach (products alone {products:.2f} ms > {budget:.2f})"
    return f"the rest must shrink {max(rest, 1e-9) / (budget - products):.1f}x"


def requirements(rows: list[tuple[int, float, float]], seed: float, partner_gain: float) -> list[str]:
    """What 3x (one run: N = 1) and 5x (batched: every N > 1, on two one-thread workers) of the seed loop need."""
    out = []
    for n, wall, products in rows:
        if n == 1:
            full, partner = 2000 / (ONE_RUN * seed), 1000 * partner_gain / (ONE_RUN * seed)
            rest = wall - products
            out.append(f"one run, {ONE_RUN:.1f}x = {ONE_RUN * seed:.1f} steps/s: one core's step within {full:.2f} "
                       f"ms with two cores fully used ({shrink(rest, products, full)}), within {partner:.2f} ms "
                       f"at the partner process's {partner_gain:.2f}x ({shrink(rest, products, partner)})")
    need = 2000 / (BATCHED * seed)
    out.append(f"batched, {BATCHED:.1f}x = {BATCHED * seed:.1f} policy-steps/s: within {need:.2f} ms per policy-step "
               "on each of two cores; " + ", ".join(f"N {n}: {shrink(w - p, p, need)}" for n, w, p in rows if n > 1))
    return out


def stepper(cfg: RLConfig, n: int):
    """A function taking one stacked RL step for n members (seeds 0..n-1) of cfg."""
    members, samplers, rngs = [], [], []
    prompts = D.read_jsonl(cfg.prompt_file)
    for k in range(n):
        c = replace(cfg, seed=k)
        policy = M.load_policy(cfg.policy_ref)[0]
        groups = torch.optim.Adam(policy.parameters(), lr=c.lr).state_dict()["param_groups"]
        members.append(_Joined(c, policy, None, groups))
        samplers.append(D.PromptSampler(prompts, c.family_weights))
        rngs.append(torch.Generator().manual_seed(k + 1))
    stack = StackedPolicy([j.policy for j in members])
    adam = StackedAdam(stack.stacked_parameters(), [j.cfg.lr for j in members])
    for m, j in enumerate(members):
        stack.bind(j.policy, m)
    frozen = Frozen.load(cfg)
    G, L = cfg.samples_per_prompt, stack.cfg["resp_len"]

    def step() -> None:
        requests = []
        for j, sampler, rng in zip(members, samplers, rngs):
            records, p = sampler.sample(cfg.batch_prompts, rng)
            requests.append((j, records, p, rollout.draw_uniforms(L, len(p) * G, rng)))
        stacked_step(stack, adam, frozen, requests)
    return step


def measure(cfg: RLConfig, n: int, steps: int) -> tuple[float, float]:
    """(wall ms, matrix-product ms) per policy-step of n batched runs on one thread."""
    from torch.profiler import ProfilerActivity, profile
    step = stepper(cfg, n)
    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - t) * 1000 / (steps * n)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    products = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in PRODUCTS) / 1000 / (steps * n)
    return wall, products


def seed_rate(cfg: RLConfig, steps: int) -> float:
    """The seed loop's steps/s at two threads."""
    torch.set_num_threads(2)
    try:
        seed_loop.train(replace(cfg, steps=3))
        t = time.perf_counter()
        seed_loop.train(replace(cfg, steps=steps))
        return steps / (time.perf_counter() - t)
    finally:
        torch.set_num_threads(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,2,4,8,16", help="comma-separated N (runs batched into one step)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--world", default=None, help="world directory (default: the default world, built once)")
    ap.add_argument("--partner-gain", type=float, default=PARTNER_GAIN, help="one run's two-core gain (make bench: "
                                                                             "ours / ours_1p)")
    a = ap.parse_args()
    ns = [int(x) for x in a.batch.split(",")]
    world = a.world or ensure_world("worlds", 0, None, "full", progress=print)[0]
    cfg = RLConfig(steps=a.steps, log_every=a.steps, batch_prompts=16, samples_per_prompt=8).resolved(world)
    torch.set_num_threads(1)
    print(f"world {world}; B=16 G=8, {a.steps} steps per N, one thread; load {os.getloadavg()[0]:.2f}")
    seed_before = seed_rate(cfg, 60)
    rows = []
    for n in ns:
        wall, products = measure(cfg, n, a.steps)
        rows.append((n, wall, products))
        print(f"  N {n:2d}: {wall:6.2f} ms per policy-step on one core, products {products:5.2f} "
              f"({products / wall:.0%}), rest {wall - products:5.2f}; two cores at best "
              f"{2000 / wall:6.1f} policy-steps/s, products alone {2000 / products:6.1f}", flush=True)
    seed = (seed_before + seed_rate(cfg, 60)) / 2
    print(f"seed loop: {seed:.2f} steps/s at two threads (mean of before and after: {seed_before:.2f}, "
          f"{seed * 2 - seed_before:.2f}); load {os.getloadavg()[0]:.2f}")
    for line in requirements(rows, seed, a.partner_gain):
        print(line)
    print("products_ms_per_policy_step: " + " ".join(f"{p:.2f}" for _, _, p in rows))
    print("rest_ms_per_policy_step: " + " ".join(f"{w - p:.2f}" for _, w, p in rows))


if __name__ == "__main__":
    main()
