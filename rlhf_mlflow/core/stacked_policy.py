"""n policies of one shape as one module: their weights stacked on a leading member axis, so that each
matmul of rollout's sampling and grouped log-probs (forward and backward) serves all n at once.

Activations are member-major: member m owns the m-th n-th of every batch's rows. The module has the
Policy's layout (tok, pos, blocks[i].{ln1, attn.{qkv, out}, ln2, ff.{0, 2}}, ln, head), with stacked
Linear and LayerNorm modules in place of torch's, and `model.linear`, `model.layer_norm` and
`model.lookup` dispatch on the weights' rank, so rollout runs the same code on one policy or on n.

Each member's own Policy can be bound to the stack (`bind`): its parameters become views of its slice,
so whatever reads it (a checkpoint, the watch) sees the stacked training's current weights; `unbind`
gives it its own copy again.
"""
from __future__ import annotations

import json

import torch
import torch.nn as nn

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import vocab as V


class StackedLinear(nn.Module):
    """n Linear layers; `weight` is (n, out, in) as nn.Linear's per member, held transposed (n, in, out)
    and contiguous, the layout a batched matmul reads without a copy."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None):
        super().__init__()
        self.weight_t = nn.Parameter(torch.stack([w.detach().t() for w in weights]).contiguous())
        self.bias = nn.Parameter(torch.stack([b.detach() for b in biases])) if biases is not None else None

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return M.linear(x, self.weight, self.bias)


class StackedLayerNorm(nn.Module):
    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor], eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.stack([w.detach() for w in weights]))  # (n, d)
        self.bias = nn.Parameter(torch.stack([b.detach() for b in biases]))
        self.normalized_shape, self.eps = (self.weight.shape[1],), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return M.layer_norm(self, x)


class StackedTable(nn.Module):
    """n embedding tables (n, rows, d)."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.weight = nn.Parameter(torch.stack([w.detach() for w in weights]))


class StackedAttention(M.Attention):
    def __init__(self, get, prefix: str, d: int, h: int):
        nn.Module.__init__(self)
        self.h, self.dk = h, d // h
        self.qkv = StackedLinear(get(prefix + "qkv.weight"), get(prefix + "qkv.bias"))
        self.out = StackedLinear(get(prefix + "out.weight"), get(prefix + "out.bias"))


class StackedBlock(nn.Module):
    def __init__(self, get, prefix: str, d: int, h: int):
        super().__init__()
        self.ln1 = StackedLayerNorm(get(prefix + "ln1.weight"), get(prefix + "ln1.bias"))
        self.attn = StackedAttention(get, prefix + "attn.", d, h)
        self.ln2 = StackedLayerNorm(get(prefix + "ln2.weight"), get(prefix + "ln2.bias"))
        self.ff = nn.Sequential(StackedLinear(get(prefix + "ff.0.weight"), get(prefix + "ff.0.bias")), nn.GELU(),
                                StackedLinear(get(prefix + "ff.2.weight"), get(prefix + "ff.2.bias")))


class StackedPolicy(nn.Module):
    """The policies `members` (one config) stacked; `keys` are the Policy's parameter names in its order."""

    def __init__(self, members: list[M.Policy]):
        super().__init__()
        if not members or len({json.dumps(p.cfg, sort_keys=True) for p in members}) != 1:
            raise ValueError("stacked policies need at least one member and one config.json shape")
        self.cfg, self.n = dict(members[0].cfg), len(members)
        self.keys = [name for name, _ in members[0].named_parameters()]
        states = [dict(p.named_parameters()) for p in members]

        def get(key: str) -> list[torch.Tensor]:
            return [s[key] for s in states]
        d, h = self.cfg["d_model"], self.cfg["n_heads"]
        self.tok, self.pos = StackedTable(get("tok.weight")), StackedTable(get("pos.weight"))
        self.blocks = nn.ModuleList([StackedBlock(get, f"blocks.{i}.", d, h) for i in range(self.cfg["n_layers"])])
        self.ln = StackedLayerNorm(get("ln.weight"), get("ln.bias"))
        self.head = StackedLinear(get("head.weight"), None)
        own = {self._key(name) for name, _ in self.named_parameters()}
        if own != set(self.keys):
            raise ValueError(f"a policy with parameters {sorted(set(self.keys) ^ own)} cannot be stacked")

    @staticmethod
    def _key(name: str) -> str:
        return name[:-len("_t")] if name.endswith(".weight_t") else name

    def first_layer_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Trunk.first_layer_table per member: (n, seq_len, vocab, d) and (n, seq_len, vocab, 3d)."""
        blk = self.blocks[0]
        x = self.tok.weight[:, None] + self.pos.weight[:, :, None]
        return x, blk.attn.qkv(blk.ln1(x))

    def content_logits(self, h: torch.Tensor) -> torch.Tensor:
        return M.linear(h, self.head.weight[:, V.CONTENT_LO:V.CONTENT_HI])

    def stacked_parameters(self) -> list[torch.Tensor]:
        """The stacked parameters in the members' Policy order (self.keys)."""
        own = {self._key(name): p for name, p in self.named_parameters()}
        return [own[k] for k in self.keys]

    def transposed(self) -> list[bool]:
        """Per parameter (self.keys' order): whether the stack holds it transposed (a Linear's weight)."""
        names = {self._key(name): name for name, _ in self.named_parameters()}
        return [names[k].endswith(".weight_t") for k in self.keys]

    def member(self, m: int) -> dict[str, torch.Tensor]:
        """Member m's parameters by Policy name, as views of the stack (no gradient)."""
        own = {name: p.detach()[m] for name, p in self.named_parameters()}
        return {self._key(name): t.t() if name.endswith(".weight_t") else t for name, t in own.items()}

    def bind(self, policy: M.Policy, m: int) -> None:
        """Policy's parameters become views of member m's slice (they follow the stacked training)."""
        _set(policy, self.member(m), lambda t: t)

    @staticmethod
    def unbind(policy: M.Policy) -> None:
        """Policy gets its own copy of its current parameters."""
        _set(policy, dict(policy.named_parameters()), lambda t: t.detach().clone())


def _set(policy: nn.Module, tensors: dict[str, torch.Tensor], make) -> None:
    for key, t in tensors.items():
        owner, _, leaf = key.rpartition(".")
        module = policy.get_submodule(owner)
        module._parameters[leaf] = nn.Parameter(make(t), requires_grad=False)
