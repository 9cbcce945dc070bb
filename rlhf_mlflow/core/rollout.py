"""The RL step's two policy passes, fast: cached sampling and grouped per-token log-probs.

Both run each prompt's positions once for its G samples (causal attention means prompt positions never
see the response) and look the first block up in `Trunk.first_layer_table`. At these sizes (T = 14,
d = 64) the cost is per-op overhead, so the code keeps the op count down; the maths is the plain
forward's, to float tolerance (tests/test_train_rl.py checks both).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import vocab as V

Table = tuple[torch.Tensor, torch.Tensor]  # Trunk.first_layer_table(): inputs and first-block q, k, v


def prefix(policy: M.Policy, prompts: torch.Tensor, table: Table
           ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run the prompt positions once: block outputs (B, P, d) and each block's keys and values (B, h, P, dk)."""
    x, qkv = M.lookup(table, prompts)  # (B, P, d), (B, P, 3d)
    mask = M.causal_mask(prompts.shape[1])
    kvs = []
    for blk in policy.blocks:
        a = blk.attn
        q, k, v = a.split_heads(a.qkv(blk.ln1(x)) if qkv is None else qkv).contiguous()  # (B, h, P, dk)
        x = x + a.merge_heads(M.attend(q, k, v, 1.0 / math.sqrt(a.dk), mask))
        x = x + blk.ff(blk.ln2(x))
        kvs.append((k, v))
        qkv = None
    return x, kvs


def grouped_logprobs(policy: M.Policy, prompts: torch.Tensor, responses: torch.Tensor, group: int,
                     table: Table | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts (B, P), responses (B*group, L) -> per-token log-probs (N, L) and log-softmax (N, L, C).

    Equal to M.token_logprobs(policy, prompts.repeat_interleave(group, 0), responses) to float
    tolerance. `table` (policy.first_layer_table()) may be passed in when the weights are frozen.
    """
    if table is None:
        table = policy.first_layer_table()
    B, P = prompts.shape
    N, L = responses.shape
    G, T = group, L - 1  # the last response token predicts nothing
    xp, kvs = prefix(policy, prompts, table)
    x, qkv = M.lookup(table, responses[:, :-1], P)  # (N, T, d), (N, T, 3d)
    mask = M.causal_mask(T, P)  # responses see the whole prompt and their own past
    for blk, prompt_kv in zip(policy.blocks, kvs):
        a = blk.attn
        q, k, v = a.split_heads(a.qkv(blk.ln1(x)) if qkv is None else qkv)  # (N, h, T, dk) views
        # keys/values: the prompt's, shared by its G samples, then each sample's own; cat (not slice
        # assignment into a buffer) because its backward is views
        k, v = (torch.cat([pk[:, None].expand(B, G, *pk.shape[1:]), sk.view(B, G, *sk.shape[1:])], 3)
                .view(N, a.h, P + T, a.dk) for pk, sk in zip(prompt_kv, (k, v)))
        x = x + a.merge_heads(M.attend(q, k, v, 1.0 / math.sqrt(a.dk), mask))
        x = x + blk.ff(blk.ln2(x))
        qkv = None
    hid = torch.cat([xp[:, -1:].repeat_interleave(G, 0), x], 1)  # (N, L, d): the prompt's last predicts y_0
    logp = torch.log_softmax(policy.content_logits(policy.ln(hid)), dim=-1)  # (N, L, C)
    tok = logp.gather(-1, (responses - V.CONTENT_LO)[..., None]).squeeze(-1)
    return tok, logp


def _ffn(blk: M.Block, x: torch.Tensor) -> torch.Tensor:
    """The block's feed-forward on ln2(x), called functionally (no module-call overhead in hot loops)."""
    ff1, ff2 = blk.ff[0], blk.ff[2]
    return M.linear(F.gelu(M.linear(M.layer_norm(blk.ln2, x), ff1.weight, ff1.bias)), ff2.weight, ff2.bias)


def draw_uniforms(L: int, N: int, generator: torch.Generator | None) -> torch.Tensor:
    """The (L, N, 1) uniforms sample_cached draws for N responses of L tokens."""
    return torch.rand(L, N, 1, generator=generator)


def _kv_cache(k: torch.Tensor, v: torch.Tensor, L: int, n: int) -> torch.Tensor:
    """A block's key/value cache laid out (position, 2, B*n, h, dk), so each new position is one
    contiguous write, with the prompt's keys and values (B, h, P, dk) in front, shared by its n samples."""
    B, h, P, dk = k.shape
    c = torch.empty(P + L, 2, B, n, h, dk)
    c[:P, 0] = k.permute(2, 0, 1, 3)[:, :, None]
    c[:P, 1] = v.permute(2, 0, 1, 3)[:, :, None]
    return c.view(P + L, 2, B * n, h, dk)


def _response_rows(table: Table, P: int, L: int, qscale: torch.Tensor, N: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(L, C, 4d): x and the first block's scaled q, k, v for each response position and content token.
    For stacked tables, (L, n * C, 4d) with member m's token c at row m * C + c, and each of the N rows'
    offset m * C (None for one policy)."""
    rows = torch.cat([table[0][..., P:P + L, V.CONTENT_LO:V.CONTENT_HI, :],
                      table[1][..., P:P + L, V.CONTENT_LO:V.CONTENT_HI, :] * qscale], -1)
    if rows.dim() == 3:
        return rows, None
    n, C = rows.shape[0], rows.shape[2]
    return rows.transpose(0, 1).reshape(L, n * C, -1), M.member_rows(N, n, C)


@torch.no_grad()
def sample_cached(policy: M.Policy, prompts: torch.Tensor, n: int, temperature: float,
                  generator: torch.Generator | None, table: Table | None = None,
                  uniforms: torch.Tensor | None = None, logprobs: list | None = None) -> torch.Tensor:
    """prompts (B, P) -> responses (B*n, L); row i belongs to prompt i // n.
    `logprobs`, when given a list, receives each response's log-probability under the distribution
    sampled from (the policy's own at temperature 1; M.sequence_logprobs to float tolerance).

    Each new token costs one position's forward against cached keys/values (the seed re-ran the whole
    prefix for each of the 8 tokens), and the first block's projection is a table lookup. Row i's
    tokens are inverse-CDF draws with uniforms[:, i] ((L, B*n, 1), drawn from `generator` if not
    given), so rows can be sampled in parts, by different processes, with the same result.
    """
    B, P = prompts.shape
    L, d, h = policy.cfg["resp_len"], policy.cfg["d_model"], policy.cfg["n_heads"]
    N, dk = B * n, d // h
    table = policy.first_layer_table() if table is None else table
    table = tuple(t.detach() for t in table)
    x, kvs = prefix(policy, prompts, table)
    caches = [_kv_cache(k, v, L, n) for k, v in kvs]
    # decode steps look up response tokens only, with the attention scale folded into q once
    qscale = torch.ones(3 * d)
    qscale[:d] = 1.0 / math.sqrt(dk)
    resp_rows, member = _response_rows(table, P, L, qscale, N)
    proj = [(b.attn.qkv.weight * qscale[:, None], b.attn.qkv.bias * qscale) for b in policy.blocks[1:]]
    head_w = policy.head.weight[..., V.CONTENT_LO:V.CONTENT_HI, :] / max(temperature, 1e-6)  # (C, d)
    last = M.layer_norm(policy.ln, x[:, -1]).repeat_interleave(n, 0)  # (N, d)
    if uniforms is None:
        uniforms = draw_uniforms(L, N, generator)
    picks, seq_lp = [], torch.zeros(N) if logprobs is not None else None
    for t in range(L):
        probs = torch.softmax(M.linear(last, head_w), dim=-1)  # (N, C)
        cdf = probs.cumsum(-1) if seq_lp is not None else probs.cumsum_(-1)
        # inverse-CDF draw, one uniform per row: the first token whose cdf reaches u * total
        idx = torch.searchsorted(cdf, uniforms[t] * cdf[:, -1:]).view(N)
        picks.append(idx)
        if seq_lp is not None:
            seq_lp += probs.gather(1, idx[:, None]).squeeze(1).log()
        if t == L - 1:
            break
        rows = resp_rows[t].index_select(0, idx if member is None else idx + member)  # (N, 4d)
        x, qkv = rows[:, :d], rows[:, d:]
        S = P + t + 1
        for i, (blk, c) in enumerate(zip(policy.blocks, caches)):
            a = blk.attn
            if i:
                qkv = M.linear(M.layer_norm(blk.ln1, x), *proj[i - 1])
            qkv = qkv.view(N, 3, h, dk)
            c[S - 1] = qkv[:, 1:].transpose(0, 1)
            # one query per row against S cached keys: elementwise products beat batched matmuls here
            w = (c[:S, 0] * qkv[:, 0]).sum(-1).softmax(0)  # (S, N, h)
            att = (w[..., None] * c[:S, 1]).sum(0)  # (N, h, dk)
            x = x + M.linear(att.view(N, d), a.out.weight, a.out.bias)
            x = x + _ffn(blk, x)
        last = M.layer_norm(policy.ln, x)
    if seq_lp is not None:
        logprobs.append(seq_lp)
    return torch.stack(picks, 1) + V.CONTENT_LO


def sample(policy: M.Policy, prompts: torch.Tensor, n_per_prompt: int = 1, temperature: float = 1.0,
           generator: torch.Generator | None = None, logprobs: list | None = None) -> torch.Tensor:
    """prompts (B, P) -> responses (B*n, L); row i belongs to prompt i // n (sample_cached's `logprobs`)."""
    return sample_cached(policy, prompts, n_per_prompt, temperature, generator, logprobs=logprobs)
