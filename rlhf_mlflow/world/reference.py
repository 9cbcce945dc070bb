"""The reference policy: supervised fine-tuning on noisy demonstrations of the truth."""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.world.truth import Truth

log = logging.getLogger(__name__)


def confusion_tables(rng: np.random.Generator) -> np.ndarray:
    """(F, L, 3, N_VAL) tokens of three wrong rules per family and position, one per other attribute."""
    return rng.integers(0, V.N_CONTENT, size=(len(V.FAMILIES), V.RESP_LEN, V.N_ATTR - 1, V.N_VAL))


def demonstrator_distribution(truth: Truth, confusions: np.ndarray, fam_idx: np.ndarray, attrs: np.ndarray,
                              noise: float, confusion: float) -> np.ndarray:
    """The demonstrators' token distribution per position (N, L, C).

    With probability 1 - noise a demonstrator writes the correct token. Otherwise, with probability
    `confusion` they follow one of three wrong rules (each keyed on one of the other attributes),
    else they write a uniformly random token. Wrong rules make the reference confident but often
    wrong, as the seed's reference was (~1.9 nats per token at ~0.29 quality).
    """
    N, L = len(fam_idx), V.RESP_LEN
    dist = np.full((N, L, V.N_CONTENT), noise * (1 - confusion) / V.N_CONTENT, dtype=np.float32)
    rows, cols = np.arange(N)[:, None], np.arange(L)[None]
    keys = truth.keys[fam_idx]  # (N, L)
    for j in range(V.N_ATTR - 1):
        vals = np.take_along_axis(attrs, (keys + j + 1) % V.N_ATTR, axis=1)  # (N, L)
        dist[rows, cols, confusions[fam_idx[:, None], cols, j, vals]] += noise * confusion / (V.N_ATTR - 1)
    dist[rows, cols, truth.targets(fam_idx, attrs)] += 1 - noise
    return dist


def demonstrations(dist: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sample demonstrated responses (N, L) as content indices from a distribution (N, L, C)."""
    cdf = dist.cumsum(-1)
    u = rng.random(dist.shape[:2])[..., None] * cdf[..., -1:]
    return np.minimum((cdf < u).sum(-1), V.N_CONTENT - 1)


def train_sft(prompts: torch.Tensor, responses: torch.Tensor, soft_targets: torch.Tensor, epochs: int,
              lr: float, batch_size: int, seed: int,
              on_epoch: Callable[[int, int, float], None] | None = None) -> M.Policy:
    """Supervised fine-tuning on demonstrations (prompts (N, P), responses (N, L) token ids).

    The loss is the expected cross-entropy under the demonstrators' distribution soft_targets
    (N, L, C), with the sampled demonstration as the teacher-forced context: the same optimum as
    cross-entropy on sampled tokens, with far less gradient noise, so it converges in a few epochs.
    `on_epoch(epoch, epochs, loss)` is called after each epoch (progress); without it, each epoch is logged.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    policy = M.Policy(M.default_config())
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    N = prompts.shape[0]
    total = epochs * ((N + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total, eta_min=lr * 0.05)
    for epoch in range(epochs):
        perm = torch.randperm(N, generator=gen)
        for i in range(0, N, batch_size):
            b = perm[i:i + batch_size]
            _, logp = M.token_logprobs(policy, prompts[b], responses[b])  # (b, L, C)
            loss = -(soft_targets[b] * logp).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if on_epoch is not None:  # the caller prints it (the world builder's progress): once
            on_epoch(epoch + 1, epochs, loss.item())
        else:
            log.info("sft epoch %d/%d: expected nll %.3f", epoch + 1, epochs, loss.item())
    return policy.eval()
