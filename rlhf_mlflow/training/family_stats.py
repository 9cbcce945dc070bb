"""Per-family accumulation of per-sample quantities, reported as `<metric>/<family>` plus
`<metric>/balanced` (equal family weights, the deployment mix)."""
from __future__ import annotations

import torch

from rlhf_mlflow.core import vocab as V

NF = len(V.FAMILIES)


def family_of(prompts: torch.Tensor) -> torch.Tensor:
    """Prompt ids (N, P) -> family index (N,) in vocab.FAMILIES."""
    return prompts[:, 0] - V.FAM_ID[V.FAMILIES[0]]


class FamilyAccumulator:
    """Sums per-sample values by family between reports; also counts response tokens per family."""

    def __init__(self, names: list[str]):
        self.names = names
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(len(self.names), NF, dtype=torch.float64)
        self.counts = torch.zeros(NF, dtype=torch.float64)
        self.tokens = torch.zeros(NF * V.N_CONTENT, dtype=torch.float64)

    def add(self, fam: torch.Tensor, values: dict[str, torch.Tensor], responses: torch.Tensor) -> None:
        """fam (N,), values name -> (N,), responses (N, L) token ids."""
        stacked = torch.stack([values[n].detach().double() for n in self.names])  # (K, N)
        self.sums.index_add_(1, fam, stacked)
        self.counts += torch.bincount(fam, minlength=NF).double()
        cells = fam[:, None] * V.N_CONTENT + (responses - V.CONTENT_LO)  # (N, L)
        self.tokens += torch.bincount(cells.reshape(-1), minlength=NF * V.N_CONTENT).double()

    def report(self) -> dict[str, float]:
        """Means per family and balanced, plus the most frequent token's share per family."""
        out: dict[str, float] = {}
        present = self.counts > 0
        means = self.sums / self.counts.clamp(min=1)  # (K, F)
        tok = self.tokens.view(NF, V.N_CONTENT)
        share = tok.max(1).values / tok.sum(1).clamp(min=1)
        for k, name in enumerate(self.names + ["top_token_share"]):
            row = means[k] if k < len(self.names) else share
            for i, f in enumerate(V.FAMILIES):
                if present[i]:
                    out[f"{name}/{f}"] = float(row[i])
            if present.any():
                out[f"{name}/balanced"] = float(row[present].mean())
        return out
