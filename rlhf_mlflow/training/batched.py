"""Several RL runs trained in one process, one batched step for all: each step samples, scores and
back-propagates every member's batch through one stacked policy (core/stacked_policy.py), the same ops
at n times the rows instead of n times the ops, which is where a run this small spends its time.

Each member is an ordinary train_rl call in its own thread (its own MLflow run, metric window,
checkpoints, watch and resume: train_rl's loop, unchanged) holding a `Seat` of one `Batch`. Its Learner is
a `Member`, whose `step` hands the member's prompts and sampling uniforms to the batch and waits: when
every member still training has handed in its step, the last one to arrive runs the stacked step for all
and each goes on with its own result. A member that finishes, stops or fails leaves; the rest go on.

Members differ in their recipe (kl_coef, lr, max_grad_norm, steps, family weights, reward wrapper,
seed, watch); they share the policy's shape, the reference policy, the reward model (or ensemble) and the
batch shape (batch_prompts, samples_per_prompt, temperature), which the batch checks as they join.
Each member's maths is the single run's, to float tolerance (tests/test_batched.py). An error inside the
shared step (a member's reward wrapper raising, the frozen models failing to load) fails every member of
the batch; an error in a member's own thread (its callbacks, its MLflow run) fails that member alone.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core.stacked_policy import StackedPolicy
from rlhf_mlflow.core.reward_wrapper import Transform
from rlhf_mlflow.training.rl_config import RLConfig
from rlhf_mlflow.training.rl_step import Frozen, policy_loss
from rlhf_mlflow.training.stacked_adam import MemberOptimizer, StackedAdam, clip_per_member

SHARED = ("policy_ref", "reward_model", "reward_ensemble", "ensemble_penalty", "batch_prompts",
          "samples_per_prompt", "temperature")
"""What every member of a batch must have in common (RLConfig fields)."""


@dataclass
class _Joined:
    cfg: RLConfig
    policy: M.Policy
    wrap: Transform | None
    param_groups: list[dict]
    """torch.optim.Adam's, as the member's checkpoints record them"""


class Batch:
    """n seats; `seats()` hands one to each member's thread (see the module's docstring)."""

    def __init__(self, n: int):
        self.n = n
        self._cond = threading.Condition()
        self._joined: dict[int, _Joined] = {}
        self._left: set[int] = set()
        self._pending: dict[int, tuple] = {}
        self._results: dict[int, object] = {}
        self._error: BaseException | None = None
        self.stack: StackedPolicy | None = None
        self.order: list[int] = []  # the seats of the stack's members, in stack order
        self.adam: StackedAdam | None = None
        self.frozen: Frozen | None = None

    def seats(self) -> list["Seat"]:
        return [Seat(self, i) for i in range(self.n)]

    def abort(self, error: BaseException) -> None:
        """Every member waiting now or later raises `error` (a signal, a failed member)."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def _raise_if_aborted(self) -> None:
        """Raise the batch's error in this member's thread: its own copy (an interrupt stays an interrupt,
        so the member's run ends KILLED; an input error stays one line)."""
        e = self._error
        if e is None:
            return
        try:
            copy = type(e)(*e.args)
        except Exception:  # noqa: BLE001 - a type that cannot be rebuilt from its args
            copy = RuntimeError(f"the batch stopped: {type(e).__name__}: {e}")
        raise copy from e

    def _join(self, i: int, joined: _Joined) -> None:
        with self._cond:
            self._raise_if_aborted()
            first = next(iter(self._joined.values()), None)
            if first is not None:
                differ = [k for k in SHARED if getattr(first.cfg, k) != getattr(joined.cfg, k)]
                if differ:
                    raise ValueError(f"runs in one batch must share {', '.join(differ)} (seat {i} differs)")
            self._joined[i] = joined
            self._ready_or_wait(lambda: self.stack is not None)

    def _leave(self, i: int) -> None:
        with self._cond:
            if i in self._left:
                return
            self._left.add(i)
            self._pending.pop(i, None)
            if i in self._joined and self.stack is not None:
                StackedPolicy.unbind(self._joined[i].policy)  # its own copy of its last weights
            self._advance()
            self._cond.notify_all()

    def _ready_or_wait(self, done: Callable[[], bool]) -> None:
        self._advance()
        self._cond.notify_all()
        while not done():
            self._raise_if_aborted()
            self._cond.wait()

    def _advance(self) -> None:
        """Build the stack once every seat has joined or left (called with the lock held)."""
        if self.stack is None and self._error is None and len(set(self._joined) | self._left) == self.n \
                and set(self._joined) - self._left:
            try:
                self._build()
            except BaseException as e:  # the frozen models did not load: every member raises it, none waits
                self._error = e
                self._cond.notify_all()
                raise
            threading.Thread(target=self._engine, name="rlhf-batch", daemon=True).start()

    def _active(self) -> list[int]:
        return [i for i in self.order if i not in self._left]

    def _engine(self) -> None:
        """The batch's steps, all in this one thread: torch's intra-op thread pool belongs to the thread
        that calls into it, and handing the work from member thread to member thread would leave the
        last caller's pool spinning on the core the next one needs."""
        with self._cond:
            while self._error is None and self._active():
                active = self._active()
                if set(self._pending) != set(active):
                    self._cond.wait()
                    continue
                try:
                    self._step(active)
                except BaseException as e:  # every waiting member raises it
                    self._results.update({i: e for i in active})
                self._pending.clear()
                self._cond.notify_all()

    def _build(self) -> None:
        self.order = [i for i in sorted(self._joined) if i not in self._left]
        members = [self._joined[i] for i in self.order]
        self.frozen = Frozen.load(members[0].cfg)
        self._restack(members, None)

    def _restack(self, members: list[_Joined], keep: list[int] | None) -> None:
        """Stack `members`' current weights (binding each policy to its slice) with their Adam state
        (the current optimiser's rows `keep`, or fresh)."""
        self.stack = StackedPolicy([j.policy for j in members])
        params = self.stack.stacked_parameters()
        self.adam = StackedAdam(params, [j.cfg.lr for j in members]) if keep is None else self.adam.select(keep, params)
        for m, j in enumerate(members):
            self.stack.bind(j.policy, m)

    def _compact(self, active: list[int]) -> None:
        """Drop the members that left from the stack (at the next step, so nobody reads it meanwhile)."""
        keep = [self.order.index(i) for i in active]
        self.order = active
        self._restack([self._joined[i] for i in active], keep)

    def _step(self, active: list[int]) -> None:
        if len(active) != self.stack.n:
            self._compact(active)
        requests = [self._pending[i] for i in self.order]
        outs, seconds = stacked_step(self.stack, self.adam, self.frozen,
                                     [(self._joined[i], *requests[k]) for k, i in enumerate(self.order)])
        for i, out in zip(self.order, outs):
            self._results[i] = (out, seconds)

    def _submit(self, i: int, request: tuple):
        with self._cond:
            self._raise_if_aborted()
            self._pending[i] = request
            self._cond.notify_all()
            while i not in self._results:
                self._raise_if_aborted()
                self._cond.wait()
            result = self._results.pop(i)
        if isinstance(result, BaseException):
            raise result
        return result


class Seat:
    """One member's place in a batch. train_rl(seat=...) joins with its policy; the member's thread must
    `release()` it when it ends, joined or not (a run that fails before training must not hold the
    others up)."""

    def __init__(self, batch: Batch, index: int):
        self.batch, self.index = batch, index

    def join(self, cfg: RLConfig, policy: M.Policy, rng: torch.Generator, wrap: Transform | None) -> "Member":
        groups = torch.optim.Adam(policy.parameters(), lr=cfg.lr, fused=True).state_dict()["param_groups"]
        self.batch._join(self.index, _Joined(cfg, policy, wrap, groups))
        return Member(self, cfg, rng)

    def release(self) -> None:
        self.batch._leave(self.index)


class Member:
    """train_rl's Learner for a member of a batch; `optimizer` is its slice of the stacked Adam."""

    def __init__(self, seat: Seat, cfg: RLConfig, rng: torch.Generator):
        self.seat, self.cfg, self.rng = seat, cfg, rng
        batch = seat.batch
        self.optimizer = MemberOptimizer(lambda: batch.adam, lambda: batch.order.index(seat.index),
                                         batch._joined[seat.index].param_groups, batch.stack.transposed())

    def step(self, records: list[dict], prompts: torch.Tensor, clock: dict[str, float]
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor, float, float]:
        """As Learner.step: this member's metrics, responses, loss and gradient norm; the batch's seconds
        per phase go to `clock` (each member's steps take the whole batched step's time)."""
        uniforms = rollout.draw_uniforms(self.seat.batch.stack.cfg["resp_len"],
                                         len(prompts) * self.cfg.samples_per_prompt, self.rng)
        out, seconds = self.seat.batch._submit(self.seat.index, (records, prompts, uniforms))
        for k, secs in seconds.items():
            clock[k] = clock.get(k, 0.0) + secs
        return out


def stacked_step(stack: StackedPolicy, adam: StackedAdam, frozen: Frozen, members: list[tuple]
                 ) -> tuple[list[tuple], dict[str, float]]:
    """One RL step for every member: members are (joined, records, prompts, uniforms) in stack order.
    Returns each member's (stats, responses, loss, grad_norm) and the seconds per phase."""
    t0 = time.perf_counter()
    G = members[0][0].cfg.samples_per_prompt
    prompts = torch.cat([m[2] for m in members])
    table = stack.first_layer_table()
    responses = rollout.sample_cached(stack, prompts, G, members[0][0].cfg.temperature, None, table,
                                      torch.cat([m[3] for m in members], 1))
    t1 = time.perf_counter()
    logprobs, logp = rollout.grouped_logprobs(stack, prompts, responses, G, table)
    ref_logprobs = frozen.ref_logprobs(prompts, responses, G)
    raw, spread = frozen.reward(prompts.repeat_interleave(G, 0), responses)
    rows = len(responses) // len(members)
    stats, losses = [], []
    for k, (joined, records, _, _) in enumerate(members):
        s = slice(k * rows, (k + 1) * rows)
        st, loss = policy_loss(joined.cfg, joined.wrap, records, responses[s], logprobs[s], logp[s],
                               ref_logprobs[s], (raw[s], None if spread is None else spread[s]))
        stats.append(st)
        losses.append(loss)
    t2 = time.perf_counter()
    params = stack.stacked_parameters()
    grads = list(torch.autograd.grad(torch.stack(losses).sum(), params))
    norms = clip_per_member(grads, torch.tensor([m[0].cfg.max_grad_norm for m in members]))
    adam.step(grads)
    t3 = time.perf_counter()
    outs = [(stats[k], responses[k * rows:(k + 1) * rows], float(losses[k].detach()), float(norms[k]))
            for k in range(len(members))]
    return outs, {"sample": t1 - t0, "score": t2 - t1, "backward": t3 - t2}

