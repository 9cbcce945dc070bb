"""Export what certify-table reads from our trained policy: its samples, and the expert set with our
models' numbers on it. Imports nothing of rlhf_mlflow.

    python examples/external_policy/export.py --world W --checkpoint ckpt --per-prompt 8 --out-dir tables

- tables/samples.jsonl: `per_prompt` samples of the policy (temperature 1) on each prompt of the world's
  expert set (data/gold_calib.jsonl), one row each: id, family, attrs, prompt_id (the expert row the
  prompt comes from: a prompt drawn twice stays two prompts), response (the 8 tokens, space-separated),
  score (the world's reward model, by our implementation), logp_policy and logp_reference (sequence
  log-probabilities under our policy and the world's reference policy).
- tables/expert_set.jsonl: the expert set's rows with prompt_id, score, logp_policy and logp_reference of
  their (reference) responses: the reference's quality, the score's calibration, off-policy evidence.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from tinylm import CONTENT, load_checkpoint, load_world, prompt_ids, response_tokens


def write_jsonl(path: str, rows: list[dict]) -> None:
    """The file appears whole: written beside, then renamed."""
    with open(path + ".partial", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".partial", path)


@torch.no_grad()
def numbers(policy, reference, rm, prompts: torch.Tensor, responses: torch.Tensor) -> list[dict]:
    """score, logp_policy and logp_reference per (prompt, response) row."""
    cols = {"score": rm.score(prompts, responses), "logp_policy": policy.logprobs(prompts, responses),
            "logp_reference": reference.logprobs(prompts, responses)}
    return [{k: round(float(v[i]), 6) for k, v in cols.items()} for i in range(len(prompts))]


def export(world: str, checkpoint: str, per_prompt: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(samples rows, expert-set rows)."""
    policy, _ = load_checkpoint(checkpoint)
    reference, rm, _, gold = load_world(world)
    prompts = torch.tensor([prompt_ids(g["family"], g["attrs"]) for g in gold])
    responses = policy.sample(prompts, per_prompt, torch.Generator().manual_seed(seed))   # (P*K, 8)
    repeated = prompts.repeat_interleave(per_prompt, 0)
    samples = []
    for i, extra in enumerate(numbers(policy, reference, rm, repeated, responses)):
        g = gold[i // per_prompt]
        samples.append({"id": f"{g['id']}-seed{seed}-{i % per_prompt}", "family": g["family"], "attrs": g["attrs"],
                        "prompt_id": g["id"], "response": " ".join(response_tokens(responses[i])), **extra})
    gold_responses = torch.tensor([[CONTENT.index(t) for t in g["response"]] for g in gold])
    expert = [{**g, "prompt_id": g["id"], **extra}
              for g, extra in zip(gold, numbers(policy, reference, rm, prompts, gold_responses))]
    return samples, expert


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", required=True, help="the world the policy was trained on")
    ap.add_argument("--checkpoint", required=True, help="a checkpoint written by train.py")
    ap.add_argument("--per-prompt", type=int, default=8, help="samples per expert-set prompt")
    ap.add_argument("--seed", type=int, default=0, help="seed of the samples")
    ap.add_argument("--out-dir", required=True, help="where samples.jsonl and expert_set.jsonl go")
    a = ap.parse_args()
    torch.set_num_threads(1)  # tiny matrices: one thread (train.py: far faster than two on a busy machine)
    samples, expert = export(a.world, a.checkpoint, a.per_prompt, a.seed)
    os.makedirs(a.out_dir, exist_ok=True)
    write_jsonl(os.path.join(a.out_dir, "samples.jsonl"), samples)
    write_jsonl(os.path.join(a.out_dir, "expert_set.jsonl"), expert)
    print(json.dumps({"samples": len(samples), "expert_set": len(expert), "out_dir": a.out_dir}))


if __name__ == "__main__":
    main()
