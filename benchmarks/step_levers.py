"""Two levers on one run's RL step, measured: splitting the step's prompts between two processes, and the
frozen scorers in bfloat16.

    python benchmarks/step_levers.py [--prompts 2,4,8,16,32] [--steps 30] [--repeats 5] [--world DIR]

**Split by prompts.** A step's prompts are independent up to the optimiser step (the baseline is per prompt
group, the loss a mean), so two processes could each run the whole step (sample, score, backward) for half
of them and add their gradients. The best such a split can do is one core's step at half the prompts against
one core's step at all of them. This measures one run's step (train_rl.Learner: sampling, log-probs, the
reference, the reward model, backward, Adam) on one thread for each --prompts (G = 8 samples each), in paired
repeats, and prints the curve: ms per step and per prompt, and `split at best: T(B) / T(B/2)`, set against
the partner process's measured gain (PARTNER_GAIN: make bench's ours / ours_1p).

**bfloat16 scorers.** The reward model and the reference take no gradient, so they could run in bfloat16
(this CPU has AVX-512 bf16; the products alone run 1.7-2.0x faster, docs/PERFORMANCE.md). This times each
in float32 and in a bfloat16 copy, end to end as the step calls it (Frozen.reward, Frozen.ref_logprobs)
on one step's responses, in paired repeats, and prints how far bfloat16 moves the rewards and the sequence
log-probs.

Last lines: `split_gain_at_best: X` (at the step's 16 prompts) and `bf16_scorers_gain: X` (the two scorers'
summed time, float32 over bfloat16).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import machine_load, paired  # noqa: E402
from benchmarks.step_composition import PARTNER_GAIN  # noqa: E402
from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import rollout  # noqa: E402
from rlhf_mlflow.training.rl_config import RLConfig  # noqa: E402
from rlhf_mlflow.training.rl_step import Frozen  # noqa: E402
from rlhf_mlflow.training.train_rl import Learner  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402

G = 8  # samples per prompt, as train_rl's default


def learner_step(world: str, prompts: int) -> Callable[[], None]:
    """One run's RL step at `prompts` prompts per step, on whatever threads torch has (no partner process)."""
    cfg = RLConfig(steps=1, log_every=1, batch_prompts=prompts, samples_per_prompt=G).resolved(world)
    policy = M.load_policy(cfg.policy_ref)[0]
    rng = torch.Generator().manual_seed(1)
    learner = Learner(cfg, policy, Frozen.load(cfg), torch.optim.Adam(policy.parameters(), lr=cfg.lr, fused=True),
                      rng, None, None)
    sampler = D.PromptSampler(D.read_jsonl(cfg.prompt_file), cfg.family_weights)
    clock: dict[str, float] = {}

    def step() -> None:
        records, p = sampler.sample(prompts, rng)
        learner.step(records, p, clock)
    return step


def paired_ms(arms: dict[str, Callable[[], object]], calls: int, repeats: int) -> tuple[dict[str, list[float]], list]:
    """ms per call of each arm, per repeat (arms rotated between repeats), and the machine around each repeat."""
    for fn in arms.values():
        for _ in range(3):
            fn()
    ms: dict[str, list[float]] = {name: [] for name in arms}
    loads = []
    for r in range(repeats):
        before, cpu0 = machine_load.mark(), machine_load.own_cpu_seconds()
        for name in paired.order(list(arms), r):
            t = time.perf_counter()
            for _ in range(calls):
                arms[name]()
            ms[name].append((time.perf_counter() - t) * 1000 / calls)
        loads.append(machine_load.between(before, machine_load.mark(), machine_load.own_cpu_seconds() - cpu0))
    return ms, loads


def split_curve(world: str, prompts: list[int], steps: int, repeats: int) -> float | None:
    """Print one core's step time against prompts per step; return T(16) / T(8) when both were measured."""
    ms, loads = paired_ms({str(b): learner_step(world, b) for b in prompts}, steps, repeats)
    med = {int(b): statistics.median(v) for b, v in ms.items()}
    print(f"one run's step on one thread ({machine_load.span(loads)}):")
    for b in prompts:
        half = f"; split at best: T({b}) / T({b // 2}) = {med[b] / med[b // 2]:.2f}" if b // 2 in med else ""
        print(f"  {b:3d} prompts ({b * G:4d} responses): {med[b]:6.2f} ms per step, {med[b] / b:5.2f} per prompt"
              f" (repeats {', '.join(f'{x:.1f}' for x in ms[str(b)])}){half}")
    if 16 in med and 8 in med:
        gain = med[16] / med[8]
        print(f"split by prompts between two processes, at best (no hand-over, no idle core): {gain:.2f}x one "
              f"core at 16 prompts; the partner process measured {PARTNER_GAIN:.2f}x (make bench: ours / ours_1p)")
        return gain
    return None


def bf16_scorers(world: str, repeats: int) -> float:
    """Print the frozen reward model's and reference's time in float32 and bfloat16, and what bfloat16 moves."""
    cfg = RLConfig(steps=1, log_every=1, batch_prompts=16, samples_per_prompt=G).resolved(world)
    f32 = Frozen.load(cfg)
    ref, rm = copy.deepcopy(f32.ref).to(torch.bfloat16), copy.deepcopy(f32.rm).to(torch.bfloat16)
    with torch.inference_mode():
        b16 = Frozen(ref, rm, ref.first_layer_table(), rm.first_layer_table())
    rng = torch.Generator().manual_seed(1)
    prompts = D.PromptSampler(D.read_jsonl(cfg.prompt_file), cfg.family_weights).sample(16, rng)[1]
    responses = rollout.sample_cached(f32.ref, prompts, G, 1.0, rng)
    rep = prompts.repeat_interleave(G, 0)
    arms = {"rm_f32": lambda: f32.reward(rep, responses), "rm_bf16": lambda: b16.reward(rep, responses),
            "ref_f32": lambda: f32.ref_logprobs(prompts, responses, G),
            "ref_bf16": lambda: b16.ref_logprobs(prompts, responses, G)}
    ms, loads = paired_ms(arms, 20, repeats)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"frozen scorers on one step's {len(responses)} responses, one thread ({machine_load.span(loads)}):")
    for k in ("rm", "ref"):
        print(f"  {k}: float32 {med[k + '_f32']:.2f} ms, bfloat16 {med[k + '_bf16']:.2f} ms "
              f"({med[k + '_f32'] / med[k + '_bf16']:.2f}x)")
    reward32, reward16 = f32.reward(rep, responses)[0], b16.reward(rep, responses)[0].float()
    seq32 = f32.ref_logprobs(prompts, responses, G).sum(-1)
    seq16 = b16.ref_logprobs(prompts, responses, G).float().sum(-1)
    print(f"  bfloat16 moves the rewards by up to {(reward32 - reward16).abs().max():.4f} (their spread: std "
          f"{reward32.std():.3f}) and the reference's sequence log-probs by up to {(seq32 - seq16).abs().max():.3f} "
          f"nats (their mean {seq32.mean():.2f})")
    return (med["rm_f32"] + med["ref_f32"]) / (med["rm_bf16"] + med["ref_bf16"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="2,4,8,16,32", help="comma-separated prompts per step")
    ap.add_argument("--steps", type=int, default=30, help="steps per arm and repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world", default=None, help="world directory (default: the default world, built once)")
    a = ap.parse_args()
    world = a.world or ensure_world("worlds", 0, None, "full", progress=print)[0]
    torch.set_num_threads(1)
    gain = split_curve(world, [int(x) for x in a.prompts.split(",")], a.steps, a.repeats)
    bf16 = bf16_scorers(world, a.repeats)
    if gain is not None:
        print(f"split_gain_at_best: {gain:.2f}")
    print(f"bf16_scorers_gain: {bf16:.2f}")


if __name__ == "__main__":
    main()
