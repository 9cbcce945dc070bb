"""Adam and gradient clipping for stacked parameters (n, ...): each member with its own learning rate,
max gradient norm and step count, and the same update as torch.optim.Adam (its defaults: betas 0.9,
0.999, eps 1e-8, no weight decay) and clip_grad_norm_ give that member alone, to float tolerance.

`MemberOptimizer` shows one member's slice in torch.optim.Adam's state_dict format, so a member's
checkpoint resumes a single run and a single run's checkpoint resumes a member (train_state.py).
"""
from __future__ import annotations

import torch

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def _per_member(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(n,) -> (n, 1, ...) broadcasting against `like` (n, ...)."""
    return v.view((-1,) + (1,) * (like.dim() - 1))


def clip_per_member(grads: list[torch.Tensor], max_norms: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_ per member (in place): each member's gradients scaled to at most its max norm.
    Returns the members' total norms (n,) before clipping."""
    n = grads[0].shape[0]
    norms = torch.stack([g.reshape(n, -1).norm(dim=1) for g in grads]).norm(dim=0)
    coef = (max_norms / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(_per_member(coef, g))
    return norms


class StackedAdam:
    def __init__(self, params: list[torch.Tensor], lrs: list[float]):
        self.params = params
        self.lr = torch.tensor(lrs, dtype=torch.float64)
        self.steps = torch.zeros(len(lrs), dtype=torch.float64)
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        self.steps += 1
        step_size = (self.lr / (1 - BETA1 ** self.steps)).float()
        root = (1 - BETA2 ** self.steps).sqrt().float()
        for p, g, m1, m2 in zip(self.params, grads, self.exp_avg, self.exp_avg_sq):
            m1.lerp_(g, 1 - BETA1)
            m2.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
            denom = (m2.sqrt() / _per_member(root, m2)).add_(EPS)
            p.sub_(m1 * _per_member(step_size, m1) / denom)

    def select(self, members: list[int], params: list[torch.Tensor]) -> "StackedAdam":
        """This optimiser's state for `members` only, over `params` (those members' stacked parameters)."""
        out = StackedAdam.__new__(StackedAdam)
        index = torch.tensor(members)
        out.params, out.lr, out.steps = params, self.lr[index], self.steps[index]
        out.exp_avg = [m[index] for m in self.exp_avg]
        out.exp_avg_sq = [m[index] for m in self.exp_avg_sq]
        return out


class MemberOptimizer:
    """Member m's view of a StackedAdam as torch.optim.Adam's state_dict / load_state_dict see it;
    `transposed[i]` says the stack holds parameter i transposed (a Linear weight, stacked_policy)."""

    def __init__(self, adam_of, m_of, param_groups: list[dict], transposed: list[bool]):
        self._adam, self._m = adam_of, m_of  # callables: the batch may re-stack between steps
        self.param_groups, self.transposed = param_groups, transposed

    def _slice(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Member m's state of parameter i, in the parameter's own shape, as a contiguous copy."""
        s = t[self._m()]
        return (s.t() if self.transposed[i] else s).clone(memory_format=torch.contiguous_format)

    def state_dict(self) -> dict:
        adam, m = self._adam(), self._m()
        if not adam.steps[m]:
            return {"state": {}, "param_groups": self.param_groups}
        step = torch.tensor(float(adam.steps[m]))
        state = {i: {"step": step.clone(), "exp_avg": self._slice(a, i), "exp_avg_sq": self._slice(b, i)}
                 for i, (a, b) in enumerate(zip(adam.exp_avg, adam.exp_avg_sq))}
        return {"state": state, "param_groups": self.param_groups}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        adam, m = self._adam(), self._m()
        state = sd["state"]
        if len(sd["param_groups"]) != 1 or len(sd["param_groups"][0]["params"]) != len(adam.params):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters")
        if sorted(state) != list(range(len(adam.params))):
            raise ValueError(f"Adam state for parameters {sorted(state)}, expected 0..{len(adam.params) - 1}")
        steps = {float(s["step"]) for s in state.values()}
        if len(steps) != 1:
            raise ValueError(f"Adam state with different steps per parameter: {sorted(steps)}")
        for i, s in state.items():
            for key, stacked in (("exp_avg", adam.exp_avg[i]), ("exp_avg_sq", adam.exp_avg_sq[i])):
                t = s[key].t() if self.transposed[i] else s[key]
                if t.shape != stacked.shape[1:]:
                    raise ValueError(f"Adam {key} of parameter {i} is {tuple(t.shape)}, expected "
                                     f"{tuple(stacked.shape[1:])}")
                stacked[m] = t
        adam.steps[m] = steps.pop()
