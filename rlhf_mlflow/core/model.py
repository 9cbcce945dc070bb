"""The policy: a tiny causal transformer over [prompt ; response] (seed-compatible layout).

Module names, state_dict keys and config.json keys match the seed's `rlhf/model.py`, so checkpoints
move both ways. On top of the seed's API this module adds what the fast paths in `rollout` (sampling, grouped
log-probs) build on: written-out attention and the first block as a lookup table.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.checkpoint import load_weights, read_config, save_module

CONFIG_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len", "prompt_len", "resp_len")
WEIGHTS = "policy.safetensors"


def default_config() -> dict:
    return {"vocab_size": len(V.TOKENS), "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128,
            "seq_len": V.SEQ_LEN, "prompt_len": V.PROMPT_LEN, "resp_len": V.RESP_LEN}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
           ) -> torch.Tensor:
    """softmax(scale * q k^T + mask) v: q (..., Tq, dk), k and v (..., Tk, dk) -> (..., Tq, dk).

    Written out (max, exp, sum) because torch's CPU softmax over a last dimension this short (T <= 14)
    is several times slower, forward and backward, than these few elementwise ops; CPU flash attention
    is slower still at these sizes. Same maths to float tolerance. The cached float32 mask follows q's
    dtype (a model cast to bfloat16: benchmarks/step_levers.py).
    """
    att = q @ k.transpose(-2, -1)  # (..., Tq, Tk)
    if mask is not None and mask.dtype != att.dtype:
        mask = mask.to(att.dtype)
    att = att.mul_(scale) if mask is None else torch.add(mask, att, alpha=scale)
    # softmax is shift-invariant, so the row max needs no gradient
    att = att.sub_(att.amax(-1, keepdim=True).detach()).exp_()
    return (att / att.sum(-1, keepdim=True)) @ v


class Attention(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h, self.dk = h, d // h
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def split_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """Projected (B, T, 3d) -> (3, B, h, T, dk): q, k, v as strided views, no copy."""
        B, T, _ = qkv.shape
        return qkv.view(B, T, 3, self.h, self.dk).permute(2, 0, 3, 1, 4)

    def merge_heads(self, a: torch.Tensor) -> torch.Tensor:
        B, h, T, dk = a.shape
        return self.out(a.transpose(1, 2).reshape(B, T, h * dk))

    def forward(self, x: torch.Tensor, causal: bool, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d); `qkv` is x's projection when the caller already has it (first block)."""
        q, k, v = self.split_heads(self.qkv(x) if qkv is None else qkv).contiguous()  # one copy, not three
        mask = causal_mask(q.shape[2]) if causal else None
        return self.merge_heads(attend(q, k, v, 1.0 / math.sqrt(self.dk), mask))


_MASKS: dict[tuple[int, int], torch.Tensor] = {}


def causal_mask(T: int, past: int = 0) -> torch.Tensor:
    """(T, past + T) additive mask: T new positions see `past` earlier ones and themselves, not later ones.

    Cached (not a buffer, so state_dict keys stay the seed's).
    """
    if (T, past) not in _MASKS:
        with torch.inference_mode(False):  # a normal tensor, usable under autograd whoever builds it first
            _MASKS[T, past] = torch.cat([torch.zeros(T, past), torch.full((T, T), float("-inf")).triu(1)], 1)
    return _MASKS[T, past]


class Block(nn.Module):
    def __init__(self, d: int, h: int, dff: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, h)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, dff), nn.GELU(), nn.Linear(dff, d))

    def forward(self, x: torch.Tensor, causal: bool = True, qkv: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x) if qkv is None else None, causal, qkv)
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

    def first_layer_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For every (position, token): the input x = tok + pos (seq_len, vocab, d) and the first block's
        q, k, v projection of ln1(x) (seq_len, vocab, 3d).

        The first block's input depends on (position, token) alone, so its LayerNorm and projection can
        run once per table row (14 x 38) and be looked up, instead of once per token of a batch (1,792
        per RL step). Differentiable: gradients reach the weights through the lookup.
        """
        blk = self.blocks[0]
        x = self.tok.weight[None] + self.pos.weight[:, None]  # (T, V, d)
        return x, blk.attn.qkv(blk.ln1(x))

    def hidden(self, ids: torch.Tensor, causal: bool = True,
               table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """ids (B, T) -> final normalised hidden states (B, T, d); `table` is first_layer_table()."""
        if table is None:
            return self.ln(self.run_blocks(self.tok(ids) + self.pos.weight[:ids.shape[1]], None, causal))
        return self.ln(self.run_blocks(*lookup(table, ids), causal))

    def run_blocks(self, x: torch.Tensor, qkv: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """The blocks over input x (B, T, d); `qkv` (B, T, 3d) is the first block's projection, if looked up."""
        for b in self.blocks:
            x, qkv = b(x, causal, qkv), None
        return x


_OFFSETS: dict[tuple[int, int, int], torch.Tensor] = {}


def lookup(table: tuple[torch.Tensor, ...], ids: torch.Tensor, start: int = 0) -> list[torch.Tensor]:
    """Rows of (positions, vocab, F) tables for ids (R, ..., T) at positions start.. -> each (R, ..., T, F).
    Stacked tables (n, positions, vocab, F) (core/stacked_policy.py) serve member m's rows of ids, the
    m-th n-th of them (member-major)."""
    S, Vn, _ = table[0].shape[-3:]
    T = ids.shape[-1]
    if (start, T, Vn) not in _OFFSETS:
        with torch.inference_mode(False):
            _OFFSETS[start, T, Vn] = torch.arange(start, start + T) * Vn
    flat = ids + _OFFSETS[start, T, Vn]
    n = table[0].shape[0] if table[0].dim() == 4 else 1
    if n > 1:
        flat = flat + member_rows(ids.shape[0], n, S * Vn).view(-1, *[1] * (ids.dim() - 1))
    return [F.embedding(flat, t.reshape(n * S * Vn, t.shape[-1])) for t in table]


def member_rows(rows: int, n: int, per_member: int) -> torch.Tensor:
    """(rows,): member m's offset m * per_member for each of `rows` member-major rows of n members."""
    if rows % n:
        raise ValueError(f"{rows} rows do not split evenly between {n} stacked members")
    return torch.arange(n).repeat_interleave(rows // n) * per_member


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b); for stacked weights w (n, out, in) and b (n, out), member m's on the m-th n-th of
    x's rows (member-major), in one batched matmul."""
    if w.dim() == 2:
        return F.linear(x, w, b)
    n = w.shape[0]
    xs, wt = x.reshape(n, -1, x.shape[-1]), w.transpose(1, 2)
    y = torch.bmm(xs, wt) if b is None else torch.baddbmm(b[:, None], xs, wt)
    return y.view(*x.shape[:-1], w.shape[1])


def layer_norm(ln: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The LayerNorm `ln` (its weight and bias, or stacked ones (n, d) as `linear` takes them) on x."""
    if ln.weight.dim() == 1:
        return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
    n, d = ln.weight.shape
    y = F.layer_norm(x, (d,), eps=ln.eps).view(n, -1, d)
    return torch.addcmul(ln.bias[:, None], y, ln.weight[:, None]).view(x.shape)


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


def token_logprobs(policy: Policy, prompts_rep: torch.Tensor, responses: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain forward: per-token log-probs (N, L) of `responses` and the full log-softmax (N, L, C)."""
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
