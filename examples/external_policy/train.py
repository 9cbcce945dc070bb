"""KL-regularised REINFORCE against a world's reward model, from its reference policy: a training loop
of our own (tinylm.py's models, our own checkpoint format). Imports nothing of rlhf_mlflow.

    python examples/external_policy/train.py --world W --steps 800 --out ckpt

Each step draws `batch_prompts` training prompts and `samples_per_prompt` responses to each at
temperature 1. A response's reward is the reward model's score minus kl_coef times its log-ratio
log pi(y|x) - log pi_ref(y|x) (a one-sample estimate of the KL to the reference); its advantage is that
reward minus the mean of its prompt's samples; the loss is -mean(advantage * log pi(y|x)). Adam, the
gradient's norm clipped at 1. Prints one JSON line of statistics every `log_every` steps.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tinylm import check_out, load_world, prompt_ids, save_checkpoint


def reinforce_step(policy, reference, rm, prompts, args, gen, opt) -> dict:
    """One policy-gradient step on prompts (B, 6); returns the batch's statistics."""
    G = args.samples_per_prompt
    responses = policy.sample(prompts, G, gen)                      # (B*G, 8)
    prompts = prompts.repeat_interleave(G, 0)                       # (B*G, 6)
    logp = policy.logprobs(prompts, responses)                      # (B*G,), with gradients
    with torch.no_grad():
        log_ratio = logp - reference.logprobs(prompts, responses)
        score = rm.score(prompts, responses)
        reward = (score - args.kl_coef * log_ratio).view(-1, G)    # (B, G)
        advantage = (reward - reward.mean(1, keepdim=True)).view(-1)
    loss = -(advantage * logp).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    return {"score": float(score.mean()), "kl": float(log_ratio.mean()), "loss": float(loss.detach())}


def train(args: argparse.Namespace) -> None:
    check_out(args.out)  # before any step, not after
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    reference, rm, train_prompts, _ = load_world(args.world)
    policy, _, _, _ = load_world(args.world)                        # starts as a copy of the reference
    policy.train()
    for p in [*reference.parameters(), *rm.parameters()]:
        p.requires_grad_(False)
    prompts = torch.tensor([prompt_ids(r["family"], r["attrs"]) for r in train_prompts])
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = prompts[torch.randint(len(prompts), (args.batch_prompts,), generator=gen)]
        stats = reinforce_step(policy, reference, rm, batch, args, gen, opt)
        if step % args.log_every == 0 or step == args.steps:
            print(json.dumps({"step": step, **{k: round(v, 4) for k, v in stats.items()},
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    meta = {"format": "external-policy/1", "model": policy.cfg,
            "training": {k: v for k, v in vars(args).items() if k != "out"}}
    save_checkpoint(policy.eval(), meta, args.out)
    print(json.dumps({"checkpoint": args.out, "steps": args.steps}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", required=True, help="a world directory in the seed's layout")
    ap.add_argument("--out", required=True, help="the checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--kl-coef", type=float, default=0.1, help="weight of the log-ratio in the reward")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch-prompts", type=int, default=16)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    torch.set_num_threads(1)  # tiny matrices: on a busy two-core machine 0.17 s a step, against 2.3 s with two threads
    train(ap.parse_args())


if __name__ == "__main__":
    main()
