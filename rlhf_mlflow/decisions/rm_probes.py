"""Interventions on a reward model: what it pays for writing a token, an adjacent pair, or a token
under a prompt attribute, measured by editing reference-policy responses and re-scoring them.

Every function takes `score(prompts (N, P), responses (N, L)) -> (N,)` (the reward model, e.g.
`functools.partial(reward_model.score, rm)`), prompts (M, P) and responses (M, L) as token ids, and
returns torch tensors; tokens are content indices 0..C-1. A fraction-of-8-correct label is a sum over positions, so its
pair *interaction* s(a,b) - s(a,.) - s(.,b) + s(.,.) is exactly zero: any interaction the reward
model shows is its own.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf_mlflow.core import vocab as V

C = V.N_CONTENT
TOKENS = torch.arange(V.CONTENT_LO, V.CONTENT_HI)
Scorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_effects(score: Scorer, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """e[m, pos, t]: score with token t written at pos minus the mean over all 24 tokens there."""
    M, L = responses.shape
    variants = responses[:, None, None, :].repeat(1, L, C, 1)  # (M, L, C, L)
    pos = torch.arange(L)
    # advanced indices on dims 1 and 3 put the indexed (position) dim first: (L, M, C)
    variants[:, pos, :, pos] = TOKENS[None, None, :].expand(L, M, -1)
    s = score(prompts.repeat_interleave(L * C, 0), variants.reshape(-1, L)).view(M, L, C)
    return s - s.mean(2, keepdim=True)


def _contexts(responses: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n (response, position) places for a pair at (pos, pos + 1), spread over the responses."""
    M, L = responses.shape
    m = torch.arange(n) % M
    pos = torch.randint(L - 1, (n,), generator=gen)
    return m, pos


def pair_screen(score: Scorer, prompts: torch.Tensor, responses: torch.Tensor, contexts: int,
                gen: torch.Generator) -> torch.Tensor:
    """Interaction of every ordered pair (a, b) at `contexts` places: (K, C, C)."""
    L = responses.shape[1]
    m, pos = _contexts(responses, contexts, gen)
    k = torch.arange(contexts)
    base = responses[m]                                          # (K, L)
    both = base[:, None, None, :].repeat(1, C, C, 1)             # (K, C, C, L)
    both[k, :, :, pos] = TOKENS[None, :, None].expand(contexts, C, C)
    both[k, :, :, pos + 1] = TOKENS[None, None, :].expand(contexts, C, C)
    first = base[:, None, :].repeat(1, C, 1)                     # (K, C, L): a at pos, original after
    first[k, :, pos] = TOKENS[None, :].expand(contexts, C)
    second = base[:, None, :].repeat(1, C, 1)                    # (K, C, L): original at pos, b after
    second[k, :, pos + 1] = TOKENS[None, :].expand(contexts, C)
    seqs = torch.cat([both.reshape(-1, L), first.reshape(-1, L), second.reshape(-1, L), base])
    p = prompts[m]
    reps = torch.cat([p.repeat_interleave(C * C, 0), p.repeat_interleave(C, 0), p.repeat_interleave(C, 0), p])
    s = score(reps, seqs)
    n2, n1 = contexts * C * C, contexts * C
    s_ab = s[:n2].view(contexts, C, C)
    s_a = s[n2:n2 + n1].view(contexts, C)
    s_b = s[n2 + n1:n2 + 2 * n1].view(contexts, C)
    s_0 = s[n2 + 2 * n1:]
    return s_ab - s_a[:, :, None] - s_b[:, None, :] + s_0[:, None, None]


def pair_confirm(score: Scorer, prompts: torch.Tensor, responses: torch.Tensor, pairs: list[tuple[int, int]],
                 contexts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Interaction (mean, SE) of each listed pair over `contexts` places, leaving out places whose
    response already holds a or b there: (N,), (N,)."""
    L = responses.shape[1]
    m, pos = _contexts(responses, contexts, gen)
    k = torch.arange(contexts)
    a = TOKENS[torch.tensor([p[0] for p in pairs])]              # (N,)
    b = TOKENS[torch.tensor([p[1] for p in pairs])]
    N = len(pairs)
    base = responses[m][:, None, :].repeat(1, 3 * N + 1, 1)      # (K, 3N+1, L)
    base[k, :N, pos] = a.expand(contexts, N)
    base[k, :N, pos + 1] = b.expand(contexts, N)
    base[k, N:2 * N, pos] = a.expand(contexts, N)
    base[k, 2 * N:3 * N, pos + 1] = b.expand(contexts, N)
    s = score(prompts[m].repeat_interleave(3 * N + 1, 0), base.reshape(-1, L)).view(contexts, 3 * N + 1)
    inter = s[:, :N] - s[:, N:2 * N] - s[:, 2 * N:3 * N] + s[:, 3 * N:]  # (K, N)
    # a place that already holds a (or b) measures no interaction: writing b (a) alone makes the pair
    orig = responses[m]
    valid = (orig[k, pos][:, None] != a[None]) & (orig[k, pos + 1][:, None] != b[None])  # (K, N)
    n = valid.sum(0).clamp(min=2)
    mean = (inter * valid).sum(0) / n
    var = (((inter - mean) * valid) ** 2).sum(0) / (n - 1)
    return mean, (var / n).sqrt()


def conditional_effects(per_response: torch.Tensor, attrs: torch.Tensor,
                        min_group: int = 2) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """For each attribute i and value v: (difference, SE) over tokens (C,) of the position-averaged
    token effect between responses whose prompt has attrs[i] == v and the others.

    per_response (M, C); attrs (M, A) values 0..V-1. The SE uses each token's variance over all
    responses, which is steadier than the few responses in one attribute cell.
    """
    var = per_response.var(0)  # (C,)
    out = {}
    for i in range(attrs.shape[1]):
        for v in range(V.N_VAL):
            on = attrs[:, i] == v
            n_on, n_off = int(on.sum()), int((~on).sum())
            if n_on < min_group or n_off < min_group:
                continue
            diff = per_response[on].mean(0) - per_response[~on].mean(0)
            out[(i, v)] = (diff, (var / n_on + var / n_off).sqrt())
    return out
