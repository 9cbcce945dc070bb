"""The hidden truth of a world: per family and response position, a key prompt attribute and a
value -> token table. True quality of a response = fraction of its 8 positions that are correct."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlhf_mlflow.core import vocab as V


@dataclass(frozen=True)
class Truth:
    keys: np.ndarray    # (F, L) which prompt attribute decides each position
    tables: np.ndarray  # (F, L, N_VAL) content index (0..23) of the correct token per attribute value

    @classmethod
    def generate(cls, rng: np.random.Generator, shared_table: bool = False) -> "Truth":
        F, L = len(V.FAMILIES), V.RESP_LEN
        keys = rng.integers(0, V.N_ATTR, size=(F, L))
        if shared_table:
            tables = np.stack([np.tile(rng.choice(V.N_CONTENT, V.N_VAL, replace=False), (L, 1)) for _ in range(F)])
        else:
            tables = np.stack([np.stack([rng.choice(V.N_CONTENT, V.N_VAL, replace=False) for _ in range(L)])
                               for _ in range(F)])
        return cls(keys=keys, tables=tables)

    def to_json(self) -> dict:
        return {"keys": self.keys.tolist(), "tables": self.tables.tolist()}

    @classmethod
    def from_json(cls, d: dict) -> "Truth":
        return cls(keys=np.asarray(d["keys"]), tables=np.asarray(d["tables"]))

    def targets(self, fam_idx: np.ndarray, attrs: np.ndarray) -> np.ndarray:
        """fam_idx (N,), attrs (N, 4) -> correct content indices (N, L)."""
        keys = self.keys[fam_idx]                                    # (N, L)
        vals = np.take_along_axis(attrs, keys, axis=1)               # (N, L)
        L = keys.shape[1]
        return self.tables[fam_idx[:, None], np.arange(L)[None], vals]

    def target_ids(self, prompts: torch.Tensor) -> torch.Tensor:
        """Prompt token ids (N, P) -> correct response token ids (N, L)."""
        fam_idx = (prompts[:, 0] - V.FAM_ID[V.FAMILIES[0]]).numpy()
        attrs = (prompts[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]).numpy()
        return torch.from_numpy(self.targets(fam_idx, attrs)).long() + V.CONTENT_LO

    def quality(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """True quality (N,) in {0, 1/8, ..., 1} of responses (N, L) to prompts (N, P)."""
        return (responses == self.target_ids(prompts)).float().mean(-1)
