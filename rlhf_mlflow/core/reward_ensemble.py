"""A reward-model ensemble: K reward models of one shape scored by one batched forward.

On disk an ensemble is a directory holding `ensemble.json` ({"members": [subdirectory, ...], ...}) and
one seed-format reward-model directory per member (rm.safetensors + config.json), written whole or not
at all (`save_ensemble`). In memory the members' weights are stacked along a leading member axis, so
every matmul of the forward pass serves all K at once (`Stacked.__call__`: ids (B, T) -> scores (K, B)),
instead of K passes over the same batch; the same maths as each member's own forward, to float tolerance.

An ensemble may carry one label head (core/label_head.py) in its directory, shared by every member: each
member's score is then the head stacked on that member's transformer (`LabelHead.combine`), as the repaired
model beside it scores with its own trunk, so the members spread where their transformers disagree, scaled
by the weight the head's stack gives the transformer in that family.

The conservative reward a policy is trained on is `penalised`: the members' mean minus k times their
standard deviation (Coste et al. 2023, "Reward Model Ensembles Help Mitigate Overoptimization"): where
the members disagree, the reward model does not know, and the policy is paid less for going there.
"""
from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core.errors import InputError, read_json
from rlhf_mlflow.core.files import atomic_dir
from rlhf_mlflow.core.label_head import LabelHead
from rlhf_mlflow.core.model import attend

MANIFEST = "ensemble.json"


def is_ensemble(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, MANIFEST))


def save_ensemble(members: list[R.RewardModel], cfg: dict, out_dir: str, info: dict | None = None,
                  head: LabelHead | None = None) -> None:
    """Members as member-<i>/ seed-format directories plus ensemble.json (their names and `info`) and the
    shared label head when given, whole or not at all."""
    if len(members) < 2:
        raise InputError(f"an ensemble needs at least 2 members, got {len(members)}")
    names = [f"member-{i}" for i in range(len(members))]
    with atomic_dir(out_dir) as tmp:
        for name, rm in zip(names, members):
            R.save_rm(rm, cfg, os.path.join(tmp, name))
        if head is not None:
            head.save(tmp)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({"members": names, **(info or {})}, f, indent=1)


def member_dirs(path: str) -> list[str]:
    """The member directories an ensemble.json names (each inside the ensemble directory)."""
    manifest = os.path.join(path, MANIFEST)
    spec = read_json(manifest, "no ensemble.json (expected a reward-model ensemble directory)")
    names = spec.get("members") if isinstance(spec, dict) else None
    if not isinstance(names, list) or len(names) < 2 or not all(isinstance(n, str) for n in names):
        raise InputError(f"{manifest}: 'members' must list at least 2 member directories")
    bad = [n for n in names if os.path.isabs(n) or ".." in n.split("/")]
    if bad:
        raise InputError(f"{manifest}: member {bad[0]!r} is outside the ensemble directory")
    return [os.path.join(path, n) for n in names]


class Stacked:
    """K reward models' weights stacked on a leading axis; calling it scores ids (B, T) -> (K, B), through
    the shared label head `head` when given."""

    def __init__(self, members: list[R.RewardModel], head: LabelHead | None = None):
        if len(members) < 2:
            raise InputError(f"an ensemble needs at least 2 members, got {len(members)}")
        shapes = {json.dumps(m.cfg, sort_keys=True) for m in members}
        if len(shapes) != 1:
            raise InputError("the ensemble's members differ in shape (config.json): they cannot be stacked")
        if any(m.label_head is not None for m in members):
            raise InputError("an ensemble member has a label head (label_head.safetensors): the stacked forward "
                             "scores transformers and one head shared by all, in the ensemble's own directory; "
                             "train members without one (repair-rm --ensemble does)")
        self.cfg, self.k, self.head = dict(members[0].cfg), len(members), head
        states = [m.state_dict() for m in members]
        self.w = {key: torch.stack([s[key].detach() for s in states]) for key in states[0]}
        # Linear weights as (K, in, out), contiguous: baddbmm copies a transposed operand on every call
        self.w.update({key: w.transpose(1, 2).contiguous() for key, w in self.w.items()
                       if key.endswith(".weight") and w.dim() == 3 and not key.startswith(("tok.", "pos."))})
        with torch.inference_mode():
            self.table = self._first_layer_table()

    def _first_layer_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Trunk.first_layer_table per member: x = tok + pos (K, S*V, d) and the first block's qkv of
        ln1(x) (K, S*V, 3d), so the first block is looked up, not run per token."""
        x = self.w["tok.weight"][:, None] + self.w["pos.weight"][:, :, None]  # (K, S, V, d)
        qkv = self._lin(self._ln(x, "blocks.0.ln1"), "blocks.0.attn.qkv")
        return x.flatten(1, 2), qkv.flatten(1, 2)

    @classmethod
    def load(cls, path: str) -> "Stacked":
        return cls([R.load_rm(d)[0] for d in member_dirs(path)], LabelHead.load(path))

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Each member's Linear `name` on its own slice of x (K, ..., in) -> (K, ..., out)."""
        w, b = self.w[name + ".weight"], self.w[name + ".bias"]
        flat = torch.baddbmm(b[:, None], x.reshape(self.k, -1, x.shape[-1]), w)
        return flat.view(*x.shape[:-1], w.shape[2])

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        shape = (self.k,) + (1,) * (x.dim() - 2) + (x.shape[-1],)
        y = F.layer_norm(x, x.shape[-1:])
        return torch.addcmul(self.w[name + ".bias"].view(shape), y, self.w[name + ".weight"].view(shape))

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        K, (B, T) = self.k, ids.shape
        h, d = self.cfg["n_heads"], self.cfg["d_model"]
        flat = ids + torch.arange(T) * self.cfg["vocab_size"]  # rows of the (position, token) table
        x, qkv = (t[:, flat] for t in self.table)  # (K, B, T, d), (K, B, T, 3d)
        for i in range(self.cfg["n_layers"]):
            p = f"blocks.{i}."
            if i:
                qkv = self._lin(self._ln(x, p + "ln1"), p + "attn.qkv")
            q, k, v = qkv.view(K, B, T, 3, h, d // h).permute(3, 0, 1, 4, 2, 5).contiguous()  # (K, B, h, T, dk)
            a = attend(q, k, v, 1.0 / math.sqrt(d // h), None).transpose(2, 3).reshape(K, B, T, d)
            x = x + self._lin(a, p + "attn.out")
            x = x + self._lin(F.gelu(self._lin(self._ln(x, p + "ln2"), p + "ff.0")), p + "ff.2")
        pooled = self._ln(x, "ln").mean(2)  # (K, B, d)
        trunk = self._lin(F.gelu(self._lin(pooled, "head.0")), "head.2").squeeze(-1)
        return trunk if self.head is None else self.head.combine(ids, trunk)

    def score(self, prompts_rep: torch.Tensor, responses: torch.Tensor, batch: int = 4096) -> torch.Tensor:
        """Scores (K, N) of responses (N, L) given repeated prompts (N, P)."""
        out = [self(torch.cat([prompts_rep[i:i + batch], responses[i:i + batch]], 1))
               for i in range(0, prompts_rep.shape[0], batch)]
        return torch.cat(out, 1) if out else torch.zeros(self.k, 0)


def penalised(scores: torch.Tensor, k: float) -> torch.Tensor:
    """The conservative reward of member scores (K, N): mean - k * standard deviation over members."""
    return scores.mean(0) - k * scores.std(0) if k else scores.mean(0)
