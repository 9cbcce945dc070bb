"""KL-regularised REINFORCE with a group-mean baseline: the seed's RL recipe, faster.

Every step: draw `batch_prompts` prompts with the family weights, sample `samples_per_prompt`
responses each, score them with the reward model (optionally reshaped by a reward wrapper), subtract
kl_coef * KL to the reference, and take one policy-gradient step. Metrics go to `on_log`; the caller
decides what to save, log or register.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core.process import raise_if_interrupted
from rlhf_mlflow.core.reward_wrapper import Transform, load_wrapper
from rlhf_mlflow.training.batched import Member, Seat
from rlhf_mlflow.training.family_stats import FamilyAccumulator, family_of
from rlhf_mlflow.training.rl_config import RLConfig
from rlhf_mlflow.training.rl_step import Frozen, metric_names, policy_loss
from rlhf_mlflow.training.train_state import TrainState, capture, restore
from rlhf_mlflow.training.two_process_step import Partner, available

log = logging.getLogger(__name__)


@dataclass
class RLResult:
    policy: M.Policy
    policy_config: dict
    history: list[tuple[int, dict]] = field(default_factory=list)
    seconds: float = 0.0
    stopped_at: int | None = None
    """The step an `on_watch` callback stopped the run at (None: it ran all its steps)."""


def update(loss: torch.Tensor, params: list[torch.Tensor], opt: torch.optim.Optimizer, max_grad_norm: float) -> float:
    """Gradients of the loss, clip, optimiser step; returns the gradient norm before clipping."""
    for p, g in zip(params, torch.autograd.grad(loss, params)):
        p.grad = g
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
    opt.step()
    return float(grad_norm)


@dataclass
class Learner:
    """Everything one RL step needs besides its prompts; `step` runs one."""
    cfg: RLConfig
    policy: M.Policy
    frozen: Frozen
    opt: torch.optim.Optimizer
    rng: torch.Generator
    wrap: Transform | None
    partner: Partner | None

    def sample(self, prompts: torch.Tensor) -> tuple[torch.Tensor, Callable[[], tuple], tuple]:
        """Sample B*G responses; returns them, a function giving their rewards (and the ensemble's spread,
        or None: Frozen.reward), and the policy's first-block table (with gradient) for the forward pass."""
        cfg, G = self.cfg, self.cfg.samples_per_prompt
        table = self.policy.first_layer_table()
        if self.partner is not None:  # it samples half and scores all while this process runs the policy
            uniforms = rollout.draw_uniforms(self.policy.cfg["resp_len"], len(prompts) * G, self.rng)
            return self.partner.sample(prompts, uniforms, table), lambda: (self.partner.rewards(), None), table
        responses = rollout.sample_cached(self.policy, prompts, G, cfg.temperature, self.rng, table)  # (N, L)
        return responses, lambda: self.frozen.reward(prompts.repeat_interleave(G, 0), responses), table

    def step(self, records: list[dict], prompts: torch.Tensor, clock: dict[str, float]
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor, float, float]:
        """Sample, score, take one policy-gradient step. Returns per-sample metrics, the responses,
        the loss and the gradient norm; adds seconds per phase to `clock`."""
        cfg, G, B = self.cfg, self.cfg.samples_per_prompt, len(prompts)
        t0 = time.perf_counter()
        responses, scores, table = self.sample(prompts)
        t1 = time.perf_counter()
        logprobs, logp = rollout.grouped_logprobs(self.policy, prompts, responses, G, table)  # (N, L), (N, L, C)
        ref_logprobs = self.frozen.ref_logprobs(prompts, responses, G)
        stats, loss = policy_loss(cfg, self.wrap, records, responses, logprobs, logp, ref_logprobs, scores())
        t2 = time.perf_counter()
        grad_norm = update(loss, list(self.policy.parameters()), self.opt, cfg.max_grad_norm)
        t3 = time.perf_counter()
        for k, secs in (("sample", t1 - t0), ("score", t2 - t1), ("backward", t3 - t2)):
            clock[k] = clock.get(k, 0.0) + secs
        return stats, responses, float(loss.detach()), grad_norm


def _report(step: int, n: int, steps_run: int, seconds: float, acc: FamilyAccumulator,
            scalars: dict[str, float]) -> dict[str, float]:
    """Metrics of the last n steps: per-family means, mean scalars, steps per second (over the
    `steps_run` of them this process ran: fewer right after a resume)."""
    metrics = acc.report()
    metrics.update({k: v / n for k, v in scalars.items()})
    metrics["steps_per_s"] = steps_run / max(seconds, 1e-9)
    if not all(math.isfinite(v) for v in metrics.values()):
        raise FloatingPointError(f"non-finite metrics at step {step}: the run diverged (try a lower lr)")
    return metrics


def _watcher(cfg: RLConfig, on_watch: OnWatch | None, policy: M.Policy,
             partner: Partner | None) -> Callable[[int], bool]:
    """step -> whether the watch says stop (never without a watch). With a partner process, the watch
    runs on both cores while the partner naps."""
    def watch(step: int) -> bool:
        if on_watch is None or not cfg.watch_every:
            return False
        with partner.both_cores() if partner is not None else contextlib.nullcontext():
            verdict = on_watch(step, policy)
        if verdict not in ("continue", "stop"):
            raise ValueError(f"on_watch returned {verdict!r}; expected 'continue' or 'stop'")
        return verdict == "stop"
    return watch


@dataclass(frozen=True)
class Resume:
    """Where a resumed run starts: a checkpoint's policy directory and its training state."""
    policy_dir: str
    state: TrainState


OnCheckpoint = Callable[[int, M.Policy, TrainState], None]
OnWatch = Callable[[int, M.Policy], str]
"""`on_watch(step, policy)` -> "continue" or "stop": called before the first step and at every step
cfg.watch_due says (every `watch_every` steps, more often before the first); "stop" ends the run there."""


def _learner(cfg: RLConfig, policy: M.Policy, rng: torch.Generator, wrap: Transform | None, seat: Seat | None,
             stack: contextlib.ExitStack) -> tuple[Learner | Member, object, Partner | None]:
    """The run's learner, optimiser and partner process (None: none). In a batch: its Member and that
    member's slice of the batch's Adam (and no partner); it leaves the batch when `stack` closes. Alone: with
    two cores, a partner process samples half of each batch and runs the reward model (not an ensemble)."""
    if seat is not None:
        stack.callback(seat.release)
        member = seat.join(cfg, policy, rng, wrap)
        return member, member.optimizer, None
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr, fused=True)
    frozen = Frozen.load(cfg)
    partner = stack.enter_context(Partner(policy, frozen.rm, frozen.rm_table, cfg.batch_prompts,
                                          cfg.samples_per_prompt, cfg.temperature)) \
        if available(torch.get_num_threads(), cfg.batch_prompts) and frozen.ensemble is None else None
    return Learner(cfg, policy, frozen, opt, rng, wrap, partner), opt, partner


def train_rl(cfg: RLConfig, on_log: Callable[[int, dict], None] | None = None,
             on_checkpoint: OnCheckpoint | None = None,
             wrapper: Transform | None = None, timings: dict | None = None,
             prompts: list[dict] | None = None, resume: Resume | None = None,
             on_watch: OnWatch | None = None, seat: Seat | None = None) -> RLResult:
    """Run the RL loop on a resolved config (absolute paths). Returns the trained policy and history.

    `wrapper` (a loaded RewardWrapper or any transform) and `prompts` (validated prompt records), when
    given, are used instead of reading cfg.reward_wrapper and cfg.prompt_file again.
    `on_checkpoint(step, policy, state)` is called every `save_every` steps with what a later `resume`
    needs; resumed from such a checkpoint, the run continues as if it had never stopped.
    `timings`, when given, accumulates seconds spent sampling, scoring (reward, log-probs, KL) and in
    backward + optimiser step. `on_watch` (see OnWatch) runs where cfg.watch_due says, when watch_every > 0.
    `seat` (a batched.Batch's): the run is one member of a batch, its steps taken together with the others'.
    """
    clock = timings if timings is not None else {}
    clock.update({k: clock.get(k, 0.0) for k in ("sample", "score", "backward")})
    torch.manual_seed(cfg.seed)
    rng = torch.Generator().manual_seed(cfg.seed + 1)
    policy, pcfg = M.load_policy(resume.policy_dir if resume else (cfg.policy_init or cfg.policy_ref))
    sampler = D.PromptSampler(prompts or D.read_jsonl(cfg.prompt_file), cfg.family_weights)
    acc, scalars, result = FamilyAccumulator(metric_names(cfg)), {"loss": 0.0, "grad_norm": 0.0}, RLResult(policy, pcfg)
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        learner, opt, partner = _learner(cfg, policy, rng, wrapper or load_wrapper(cfg.reward_wrapper), seat, stack)
        start = 0
        if resume is not None:
            scalars, result.history = restore(resume.state, opt, rng, acc)
            start = resume.state.step
        t_window, window_from = time.perf_counter(), start
        watch = _watcher(cfg, on_watch, policy, partner)
        if start == 0:
            watch(0)  # the reference's point: nothing to stop yet
        for step in range(start + 1, cfg.steps + 1):
            raise_if_interrupted()
            records, prompts = sampler.sample(cfg.batch_prompts, rng)
            stats, responses, loss, grad_norm = learner.step(records, prompts, clock)
            acc.add(family_of(prompts).repeat_interleave(cfg.samples_per_prompt), stats, responses)
            scalars["loss"] += loss
            scalars["grad_norm"] += grad_norm
            stop = cfg.watch_due(step) and watch(step)
            if step % cfg.log_every == 0 or step == cfg.steps or stop:
                n, seconds = step % cfg.log_every or cfg.log_every, time.perf_counter() - t_window
                result.history.append((step, _report(step, n, step - window_from, seconds, acc, scalars)))
                if on_log is not None:
                    on_log(*result.history[-1])
                acc.reset()
                scalars = dict.fromkeys(scalars, 0.0)
                t_window, window_from = time.perf_counter(), step
            if cfg.save_every and step % cfg.save_every == 0 and step != cfg.steps and not stop and on_checkpoint:
                on_checkpoint(step, policy, capture(step, opt, rng, acc, scalars, result.history))
            if stop:
                result.stopped_at = step
                break
    policy.eval()
    result.seconds = time.perf_counter() - t_start
    return result
