"""The policy: a tiny causal transformer over [prompt ; response] (seed-compatible layout).

Module names, state_dict keys and config.json keys match the seed's `rlhf/model.py`, so checkpoints
move both ways. On top of the seed's API this module adds a key/value-cached sampler and a single
forward pass that returns per-token log-probs and entropy together.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import vocab as V
from .checkpoint import load_weights, read_config, save_module

CONFIG_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len", "prompt_len", "resp_len")
WEIGHTS = "policy.safetensors"


def default_config() -> dict:
    return {"vocab_size": len(V.TOKENS), "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128,
            "seq_len": V.SEQ_LEN, "prompt_len": V.PROMPT_LEN, "resp_len": V.RESP_LEN}


class Attention(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h, self.dk = h, d // h
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def split_heads(self, x: torch.Tensor):
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.h, self.dk).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # each (B, h, T, dk)

    def merge_heads(self, a: torch.Tensor) -> torch.Tensor:
        B, h, T, dk = a.shape
        return self.out(a.transpose(1, 2).reshape(B, T, h * dk))

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        # Explicit attention: at T=14 and head size 16-24, CPU flash attention (and its backward)
        # costs more than these two small batched matmuls; the result is the same to float tolerance.
        q, k, v = self.split_heads(x)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.dk))  # (B, h, T, T)
        if causal:
            att = att + _causal_mask(x.shape[1])
        return self.merge_heads(att.softmax(-1) @ v)


_MASKS: dict[int, torch.Tensor] = {}


def _causal_mask(T: int) -> torch.Tensor:
    """(T, T) additive mask, -inf above the diagonal; cached (not a buffer, so state_dict keys stay the seed's)."""
    if T not in _MASKS:
        _MASKS[T] = torch.full((T, T), float("-inf")).triu(1)
    return _MASKS[T]


class Block(nn.Module):
    def __init__(self, d: int, h: int, dff: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, h)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, dff), nn.GELU(), nn.Linear(dff, d))

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), causal)
        return x + self.ff(self.ln2(x))


class Trunk(nn.Module):
    """Embeddings, blocks and final LayerNorm: the layout (and state_dict keys) both models share."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = dict(cfg)
        d = cfg["d_model"]
        self.tok = nn.Embedding(cfg["vocab_size"], d)
        self.pos = nn.Embedding(cfg["seq_len"], d)
        self.blocks = nn.ModuleList([Block(d, cfg["n_heads"], cfg["d_ff"]) for _ in range(cfg["n_layers"])])
        self.ln = nn.LayerNorm(d)

    def hidden(self, ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
        """ids (B, T) -> final normalised hidden states (B, T, d)."""
        x = self.tok(ids) + self.pos.weight[:ids.shape[1]]
        for b in self.blocks:
            x = b(x, causal)
        return self.ln(x)


class Policy(Trunk):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.head = nn.Linear(cfg["d_model"], cfg["vocab_size"], bias=False)

    def content_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., d) -> logits over the 24 content tokens only (..., C)."""
        return F.linear(h, self.head.weight[V.CONTENT_LO:V.CONTENT_HI])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, vocab); non-content tokens are set to -1e9 (the seed's contract)."""
        logits = self.head(self.hidden(ids))
        out = torch.full_like(logits, -1e9)
        out[..., V.CONTENT_LO:V.CONTENT_HI] = logits[..., V.CONTENT_LO:V.CONTENT_HI]
        return out


def save_policy(policy: Policy, cfg: dict, out_dir: str) -> None:
    save_module(policy, cfg, out_dir, WEIGHTS)


def load_policy(ckpt_dir: str) -> tuple[Policy, dict]:
    cfg = read_config(ckpt_dir, CONFIG_KEYS)
    policy = Policy(cfg)
    load_weights(policy, ckpt_dir, WEIGHTS)
    return policy, cfg


def _prefix(policy: Policy, prompts: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run the prompt positions once: hidden states (B, P, d) and each block's keys/values (B, h, P, dk).

    Causal attention means prompt positions never see the response, so the G samples of a prompt
    share these exactly; computing them once per prompt instead of once per sample saves work.
    """
    x = policy.tok(prompts) + policy.pos.weight[:prompts.shape[1]]
    kvs = []
    for blk in policy.blocks:
        q, k, v = blk.attn.split_heads(blk.ln1(x))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(blk.attn.dk)) + _causal_mask(x.shape[1])
        x = x + blk.attn.merge_heads(att.softmax(-1) @ v)
        x = x + blk.ff(blk.ln2(x))
        kvs.append((k, v))
    return x, kvs


def _ffn(blk: Block, x: torch.Tensor) -> torch.Tensor:
    """The block's feed-forward on ln2(x), called functionally (no module-call overhead in hot loops)."""
    ff1, ff2 = blk.ff[0], blk.ff[2]
    h = F.layer_norm(x, blk.ln2.normalized_shape, blk.ln2.weight, blk.ln2.bias, blk.ln2.eps)
    return F.linear(F.gelu(F.linear(h, ff1.weight, ff1.bias)), ff2.weight, ff2.bias)


@torch.no_grad()
def sample(policy: Policy, prompts: torch.Tensor, n_per_prompt: int = 1, temperature: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """prompts (B, P) -> responses (B*n, L); row i belongs to prompt i // n.

    The prompt is run once per prompt and each new token costs one position's forward against
    cached keys/values (the seed re-ran the whole prefix for each of the 8 tokens).
    """
    B, P = prompts.shape
    n, L = n_per_prompt, policy.cfg["resp_len"]
    N = B * n
    d = policy.cfg["d_model"]
    h = policy.cfg["n_heads"]
    dk = d // h
    x, kvs = _prefix(policy, prompts)
    # cache laid out (position, 2, N, h, dk) so each new position is one contiguous write
    caches = []
    for k, v in kvs:
        kv = torch.empty(P + L, 2, N, h, dk)
        kv[:P, 0] = k.repeat_interleave(n, 0).permute(2, 0, 1, 3)
        kv[:P, 1] = v.repeat_interleave(n, 0).permute(2, 0, 1, 3)
        caches.append(kv)
    last = policy.ln(x[:, -1]).repeat_interleave(n, 0)  # (N, d)
    out = torch.empty(N, L, dtype=torch.long)
    inv_temp = 1.0 / max(temperature, 1e-6)
    scale = 1.0 / math.sqrt(dk)
    head_w = policy.head.weight[V.CONTENT_LO:V.CONTENT_HI] * inv_temp  # (C, d), temperature folded in
    tok_w, pos_w = policy.tok.weight, policy.pos.weight
    uniforms = torch.rand(L, N, 1, generator=generator)
    for t in range(L):
        probs = torch.softmax(F.linear(last, head_w), dim=-1)  # (N, C)
        cdf = probs.cumsum(-1)
        # inverse-CDF draw: one uniform per row, cheaper than multinomial's exponential race
        idx = (cdf < uniforms[t] * cdf[:, -1:]).sum(-1).clamp_(max=V.N_CONTENT - 1) + V.CONTENT_LO
        out[:, t] = idx
        if t == L - 1:
            break
        x = tok_w[idx] + pos_w[P + t]  # (N, d)
        S = P + t + 1
        for blk, kv in zip(policy.blocks, caches):
            a = blk.attn
            hx = F.layer_norm(x, blk.ln1.normalized_shape, blk.ln1.weight, blk.ln1.bias, blk.ln1.eps)
            qkv = F.linear(hx, a.qkv.weight, a.qkv.bias).view(N, 3, h, dk)
            kv[S - 1] = qkv[:, 1:].transpose(0, 1)
            q = qkv[:, 0] * scale
            # one query per row against S cached keys: elementwise products beat batched matmuls here
            w = (kv[:S, 0] * q).sum(-1).softmax(0)  # (S, N, h)
            att = (w[..., None] * kv[:S, 1]).sum(0)  # (N, h, dk)
            x = x + F.linear(att.reshape(N, d), a.out.weight, a.out.bias)
            x = x + _ffn(blk, x)
        last = F.layer_norm(x, policy.ln.normalized_shape, policy.ln.weight, policy.ln.bias, policy.ln.eps)
    return out


def grouped_token_logprobs(policy: Policy, prompts: torch.Tensor, responses: torch.Tensor, group: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logprobs for `group` responses per prompt, running each prompt's positions once.

    prompts (B, P), responses (B*group, L) -> per-token log-probs (N, L) and log-softmax (N, L, C).
    Equal to token_logprobs(policy, prompts.repeat_interleave(group, 0), responses) to float tolerance.
    """
    B, P = prompts.shape
    N, L = responses.shape
    dk = policy.cfg["d_model"] // policy.cfg["n_heads"]
    xp, kvs = _prefix(policy, prompts)
    x = policy.tok(responses[:, :-1]) + policy.pos.weight[P:P + L - 1]  # (N, L-1, d)
    mask = torch.cat([torch.zeros(L - 1, P), _causal_mask(L - 1)], 1)  # suffix sees the prompt + its past
    for blk, (kp, vp) in zip(policy.blocks, kvs):
        q, k, v = blk.attn.split_heads(blk.ln1(x))  # (N, h, L-1, dk)
        keys = torch.cat([kp.repeat_interleave(group, 0), k], 2)  # (N, h, P+L-1, dk)
        values = torch.cat([vp.repeat_interleave(group, 0), v], 2)
        att = (q @ keys.transpose(-2, -1)) * (1.0 / math.sqrt(dk)) + mask
        x = x + blk.attn.merge_heads(att.softmax(-1) @ values)
        x = x + blk.ff(blk.ln2(x))
    hid = torch.cat([xp[:, -1:].repeat_interleave(group, 0), x], 1)  # (N, L, d)
    logp = torch.log_softmax(policy.content_logits(policy.ln(hid)), dim=-1)  # (N, L, C)
    tok = logp.gather(-1, (responses - V.CONTENT_LO)[..., None]).squeeze(-1)
    return tok, logp


def token_logprobs(policy: Policy, prompts_rep: torch.Tensor, responses: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward: per-token log-probs (N, L) of `responses` and the full log-softmax (N, L, C)."""
    P = prompts_rep.shape[1]
    ids = torch.cat([prompts_rep, responses], 1)  # (N, P+L)
    h = policy.hidden(ids[:, :-1])[:, P - 1:]  # positions that predict the response, (N, L, d)
    logp = torch.log_softmax(policy.content_logits(h), dim=-1)  # (N, L, C)
    tok = logp.gather(-1, (responses - V.CONTENT_LO)[..., None]).squeeze(-1)
    return tok, logp


def response_logprobs(policy: Policy, prompts_rep: torch.Tensor, responses: torch.Tensor,
                      with_entropy: bool = False):
    """Per-token log-probs (N, L); with_entropy also returns the mean token entropy per sequence (N,)."""
    tok, logp = token_logprobs(policy, prompts_rep, responses)
    if with_entropy:
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1).mean(-1)
        return tok, ent
    return tok


def entropy(policy: Policy, prompts_rep: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    return response_logprobs(policy, prompts_rep, responses, with_entropy=True)[1]


@torch.no_grad()
def sequence_logprobs(policy: Policy, prompts_rep: torch.Tensor, responses: torch.Tensor,
                      batch: int = 4096) -> torch.Tensor:
    """Exact log pi(y|x) per sequence (N,), batched, without gradients."""
    out = [response_logprobs(policy, prompts_rep[i:i + batch], responses[i:i + batch]).sum(-1)
           for i in range(0, prompts_rep.shape[0], batch)]
    return torch.cat(out) if out else torch.zeros(0)
