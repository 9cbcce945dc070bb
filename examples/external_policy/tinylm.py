"""A tiny transformer policy and reward model that load a world's seed-format weights.

Written from the seed's documented layout (README "The world", docs/WORLD.md), not from rlhf_mlflow's
code: this example imports nothing of rlhf_mlflow. It stands for a team's own stack, with its own module
names and its own checkpoint format (safetensors under this file's key names, beside a meta.json).

Sequence: [<family>, v_a1..v_a4, <sep>] (6 prompt tokens) then 8 response tokens, each one of 24
content tokens. Pre-norm blocks (LayerNorm, attention, LayerNorm, GELU MLP), learned positions, a final
LayerNorm. The policy is causal with an unbiased unembedding read on content tokens only; the reward
model attends both ways, mean-pools the 14 positions and scores with a two-layer head.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

FAMILIES = ["anvil", "birch", "cobalt", "dune", "ember", "fjord"]
CONTENT = "ba da fa ga ha ja ka la ma na pa ra sa ta va wa za be de fe ge he je ke".split()
VOCAB = ["<pad>", "<sep>"] + [f"<{f}>" for f in FAMILIES] + [f"v{i}" for i in range(8)] + CONTENT
FIRST_CONTENT = VOCAB.index(CONTENT[0])  # content tokens are the last 24 ids, contiguous
PROMPT_LEN, RESPONSE_LEN = 6, 8


def prompt_ids(family: str, attrs: list[int]) -> list[int]:
    return [VOCAB.index(f"<{family}>")] + [VOCAB.index(f"v{a}") for a in attrs] + [VOCAB.index("<sep>")]


def response_tokens(content_ids) -> list[str]:
    """Response ids counted among the 24 content tokens (0..23) -> token strings."""
    return [CONTENT[int(i)] for i in content_ids]


class Layer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        B, T, W = x.shape
        q, k, v = (t.view(B, T, self.heads, W // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(W, -1))       # each (B, heads, T, W/heads)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, W))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Body(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg, w = dict(cfg), cfg["d_model"]
        self.embed, self.position = nn.Embedding(cfg["vocab_size"], w), nn.Embedding(cfg["seq_len"], w)
        self.layers = nn.ModuleList([Layer(w, cfg["n_heads"], cfg["d_ff"]) for _ in range(cfg["n_layers"])])
        self.final_norm = nn.LayerNorm(w)

    def states(self, ids: torch.Tensor, causal: bool) -> torch.Tensor:
        x = self.embed(ids) + self.position.weight[: ids.shape[1]]     # (B, T, W)
        for layer in self.layers:
            x = layer(x, causal)
        return self.final_norm(x)


class Policy(Body):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.unembed = nn.Linear(cfg["d_model"], cfg["vocab_size"], bias=False)

    def content_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, 24): next-token logits over the content tokens only."""
        return self.states(ids, causal=True) @ self.unembed.weight[FIRST_CONTENT:].T

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        """prompts (B, 6) -> content ids (B*n, 8), row i answering prompt i // n, at temperature 1."""
        ids = prompts.repeat_interleave(n, 0)
        for _ in range(RESPONSE_LEN):
            probs = self.content_logits(ids)[:, -1].softmax(-1)
            ids = torch.cat([ids, FIRST_CONTENT + torch.multinomial(probs, 1, generator=gen)], 1)
        return ids[:, PROMPT_LEN:] - FIRST_CONTENT

    def logprobs(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """log pi(response | prompt) per sequence (B,), responses as content ids (B, 8)."""
        ids = torch.cat([prompts, responses + FIRST_CONTENT], 1)
        logp = self.content_logits(ids[:, :-1])[:, PROMPT_LEN - 1:].log_softmax(-1)   # (B, 8, 24)
        return logp.gather(-1, responses[..., None]).squeeze(-1).sum(-1)


class RewardModel(Body):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        w = cfg["d_model"]
        self.score_hidden, self.score_out = nn.Linear(w, w), nn.Linear(w, 1)

    @torch.no_grad()
    def score(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """(B, 6) prompts, (B, 8) content ids -> (B,) scores."""
        pooled = self.states(torch.cat([prompts, responses + FIRST_CONTENT], 1), causal=False).mean(1)
        return self.score_out(F.gelu(self.score_hidden(pooled))).squeeze(-1)


SEED_NAMES = [(r"^tok\.", "embed."), (r"^pos\.", "position."), (r"^ln\.", "final_norm."), (r"^blocks\.", "layers."),
              (r"\.ln1\.", ".norm1."), (r"\.ln2\.", ".norm2."), (r"\.attn\.qkv\.", ".qkv."), (r"\.attn\.out\.", ".proj."),
              (r"\.ff\.0\.", ".up."), (r"\.ff\.2\.", ".down."), (r"^head\.weight$", "unembed.weight"),
              (r"^head\.0\.", "score_hidden."), (r"^head\.2\.", "score_out.")]
"""The seed's state_dict names -> ours."""


def load_seed(directory: str, kind: type[Body], weights: str) -> Body:
    """A seed-format checkpoint (`weights` safetensors + config.json), strictly: every tensor named."""
    with open(os.path.join(directory, "config.json")) as f:
        model = kind(json.load(f))
    state = {}
    for name, tensor in load_file(os.path.join(directory, weights)).items():
        for pattern, ours in SEED_NAMES:
            name = re.sub(pattern, ours, name)
        state[name] = tensor
    model.load_state_dict(state)
    return model.eval()


def load_world(world: str) -> tuple[Policy, RewardModel, list[dict], list[dict]]:
    """The world's reference policy, reward model, training prompts and expert set."""
    def rows(path):
        with open(os.path.join(world, "data", path)) as f:
            return [json.loads(line) for line in f if line.strip()]
    return (load_seed(os.path.join(world, "policy"), Policy, "policy.safetensors"),
            load_seed(os.path.join(world, "reward_model"), RewardModel, "rm.safetensors"),
            rows("prompts_train.jsonl"), rows("gold_calib.jsonl"))


CHECKPOINT_FILES = {"weights.safetensors", "meta.json"}


def check_out(out: str) -> None:
    """Refuse to replace a directory that is not one of our checkpoints (nor empty)."""
    if os.path.exists(out) and (not os.path.isdir(out) or set(os.listdir(out)) - CHECKPOINT_FILES):
        raise SystemExit(f"error: {out} exists and is not a checkpoint of ours: give a new or empty directory")


def save_checkpoint(policy: Policy, meta: dict, out: str) -> None:
    """Our own format: out/weights.safetensors (our key names) and out/meta.json, written beside, then renamed."""
    check_out(out)
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.detach().contiguous() for k, v in policy.state_dict().items()}, os.path.join(tmp, "weights.safetensors"))
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


def load_checkpoint(directory: str) -> tuple[Policy, dict]:
    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    policy = Policy(meta["model"])
    policy.load_state_dict(load_file(os.path.join(directory, "weights.safetensors")))
    return policy.eval(), meta
