"""The label head: what a repaired reward model learned from expert labels, beside its trunk.

A label scores a whole response, but what decides it is local: which token stands at each position
given the prompt's attributes. The head is, per family, a linear function of the indicators
"token t at response position p while prompt attribute i has value v" (8 x 24 x 4 x 8 = 6,144 per
family), fitted by L1-regularised least squares (core/label_head_fit.py: an adaptive group lasso), so
a few hundred labels pick out the few indicators that matter. The repaired score is

    score = neural[f] * trunk score + bias[f] + sum over p, i of coef[f, p, token_p, i, attr_i]

with the weights chosen per family by cross-validation (the trunk keeps its weight where the labels
say little). The head lives in its own file beside the seed-format weights, so a seed-format loader
still reads the directory (and gets the trunk alone).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError

FILE = "label_head.safetensors"
SHAPE = (len(V.FAMILIES), V.RESP_LEN, V.N_CONTENT, V.N_ATTR, V.N_VAL)
PER_FAMILY = V.RESP_LEN * V.N_CONTENT * V.N_ATTR * V.N_VAL
"""Indicators per family."""


def indicator_index(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[prompt ; response] ids (N, T) -> (family index (N,), flat indicator indices (N, L * A) into a
    family's PER_FAMILY coefficients). A response token outside the content range indexes nothing: -1."""
    fam = ids[:, 0] - V.FAM_ID[V.FAMILIES[0]]
    attrs = ids[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]                                   # (N, A)
    tok = ids[:, V.PROMPT_LEN:V.PROMPT_LEN + V.RESP_LEN] - V.CONTENT_LO            # (N, L)
    pos = torch.arange(V.RESP_LEN)[None, :, None]
    att = torch.arange(V.N_ATTR)[None, None, :]
    flat = ((pos * V.N_CONTENT + tok[:, :, None]) * V.N_ATTR + att) * V.N_VAL + attrs[:, None, :]
    bad = ((tok < 0) | (tok >= V.N_CONTENT))[:, :, None].expand_as(flat)
    return fam, flat.masked_fill(bad, -1).reshape(len(ids), -1)


def in_block(flat: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Indicator indices (N, k) within a block of PER_FAMILY (a family's) -> within all blocks laid end to
    end, row i's in block[i] (-1 stays -1)."""
    return torch.where(flat >= 0, flat + block[:, None] * PER_FAMILY, flat)


def indicator_sum(coef: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Sum of coefficients (K,) over each row's indicators (N, k) indexing them (-1: none)."""
    return torch.where(flat >= 0, coef[flat.clamp(min=0)], coef.new_zeros(())).sum(1)


@dataclass
class LabelHead:
    coef: torch.Tensor    # SHAPE
    neural: torch.Tensor  # (F,) the trunk score's weight
    bias: torch.Tensor    # (F,)

    def __post_init__(self):
        F = len(V.FAMILIES)
        if tuple(self.coef.shape) != SHAPE or tuple(self.neural.shape) != (F,) or tuple(self.bias.shape) != (F,):
            raise InputError(f"label head: tensors of shapes {tuple(self.coef.shape)}, {tuple(self.neural.shape)}, "
                             f"{tuple(self.bias.shape)}; expected {SHAPE}, ({F},), ({F},)")
        for name in ("coef", "neural", "bias"):
            t = getattr(self, name).float()
            if not bool(torch.isfinite(t).all()):
                raise InputError(f"label head: {name} holds non-finite values")
            setattr(self, name, t)

    @property
    def uses_trunk(self) -> bool:
        """False when every family's score is the head's alone (the trunk need not run)."""
        return bool((self.neural != 0).any())

    def parts(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For [prompt ; response] ids (N, T): the head's own score (N,) and the weight (N,) its family's
        stack gives the trunk's score."""
        fam, flat = indicator_index(ids)
        fam = fam.clamp(0, len(V.FAMILIES) - 1)
        return self.bias[fam] + indicator_sum(self.coef.reshape(-1), in_block(flat, fam)), self.neural[fam]

    def combine(self, ids: torch.Tensor, trunk: torch.Tensor | None) -> torch.Tensor:
        """The repaired score (N,) of [prompt ; response] ids (N, T), given the trunk's scores (N,), or
        (..., N) for several trunks (None when `uses_trunk` is False)."""
        own, weight = self.parts(ids)
        return own if trunk is None else own + weight * trunk.to(own.dtype)

    def save(self, out_dir: str) -> None:
        with open(os.path.join(out_dir, FILE), "wb") as f:
            f.write(save({"coef": self.coef.contiguous(), "neural": self.neural.contiguous(),
                          "bias": self.bias.contiguous()}))

    @classmethod
    def load(cls, ckpt_dir: str) -> "LabelHead | None":
        """The head saved in `ckpt_dir`, or None when it has none."""
        path = os.path.join(ckpt_dir, FILE)
        if not os.path.isfile(path):
            return None
        try:
            t = load_file(path)
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise InputError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        missing = {"coef", "neural", "bias"} - set(t)
        if missing:
            raise InputError(f"{path}: lacks {sorted(missing)} (expected coef, neural, bias)")
        try:
            return cls(t["coef"], t["neural"], t["bias"])
        except InputError as e:
            raise InputError(f"{path}: {e}") from None
