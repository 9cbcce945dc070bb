"""A second process for the RL step when the run has two cores: it samples half of each batch and
scores the whole batch with the reward model while this process samples the other half and runs the
policy (with gradient) and the reference.

Why a process and not a thread: at these sizes an RL step is thousands of small torch calls, and two
Python threads spend their time handing the GIL back and forth (measured: two threads ran slower
than one). Why spinning and not blocking: on this VM a process that blocks on a pipe gives up its
virtual CPU, and waking it costs more than the step's parallel work gains (measured: a pipe-signalled
version ran at 60% of one process, the same code spinning on shared flags at 125%).

The partner is forked after the models are loaded, so it shares them: the policy's parameters live in
shared memory (each optimiser step is visible to it), the frozen reference and reward model are
inherited copies. Inputs and outputs pass through shared tensors; small integer flags order the two.
The random stream stays this process's: it draws the prompts and the sampling uniforms, and each
process samples its rows with their uniforms (rollout.sample_cached), so the responses are the ones
one process would draw, to float tolerance.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import rollout

# flag slots: the step the partner should run (STOP ends it), the last step each side finished a phase of,
# whether it failed, and whether this process has both cores for a while (Partner.both_cores)
GO, PARTNER_SAMPLED, MAIN_SAMPLED, SCORED, FAILED, AWAY = range(6)
STOP = -1
SPIN_SECONDS = 0.05  # busy-wait this long, then nap between looks (see wait_for)


class PartnerFailed(RuntimeError):
    pass


def wait_for(flags, slot: int, seq: int, still_ok: Callable[[], bool]) -> bool:
    """Spin until flags[slot] >= seq; True then, False as soon as still_ok() says no (asked every 4096
    looks). After SPIN_SECONDS of waiting, or at once when flags[AWAY] says so, the other side is away
    (logging, saving a checkpoint, the watch), so nap between looks instead of holding a CPU it may
    want: 100 us, or 1 ms while flags[AWAY] (a 100 us nap loop costs ~6% of a core, a 1 ms one ~2%)."""
    start, looks, idle = time.perf_counter(), 0, False
    while flags[slot] < seq:
        looks += 1
        if idle:
            time.sleep(1e-3 if flags[AWAY] else 1e-4)
        if looks % 4096 == 0 or idle:
            if not still_ok():
                return False
            idle = idle or bool(flags[AWAY]) or time.perf_counter() - start > SPIN_SECONDS
    return still_ok()


PARTNER_ENV = "RLHF_PARTNER"
PARTNER_MODES = ("auto", "on", "off")
"""RLHF_PARTNER: `off` never starts the partner (one process at the run's threads); `on` starts it
wherever it can run (the conditions in `available`); `auto`, the default, is today the same as `on`
(docs/PERFORMANCE.md: which mode was faster on which machine class)."""


def partner_mode() -> str:
    """RLHF_PARTNER's value (unset or empty: auto); a ValueError naming the valid values otherwise."""
    mode = os.environ.get(PARTNER_ENV, "").strip().lower() or "auto"
    if mode not in PARTNER_MODES:
        raise ValueError(f"{PARTNER_ENV}={os.environ[PARTNER_ENV]!r}: expected one of {', '.join(PARTNER_MODES)}")
    return mode


def available(threads: int, batch_prompts: int) -> bool:
    """Worth starting: not switched off (RLHF_PARTNER=off), two threads granted and two CPUs to run them
    (the two sides spin while they wait, which on one CPU would starve the other), a batch to split,
    and fork (Linux) to share the models."""
    return (partner_mode() != "off" and threads >= 2 and batch_prompts >= 2 and sys.platform == "linux"
            and len(os.sched_getaffinity(0)) >= 2)


class Partner:
    """Owns the partner process and the shared buffers of one RL run; per step, sample() then rewards()."""

    def __init__(self, policy: M.Policy, rm: R.RewardModel, rm_table: tuple[torch.Tensor, torch.Tensor],
                 batch_prompts: int, group: int, temperature: float):
        P, L = policy.cfg["prompt_len"], policy.cfg["resp_len"]
        N = batch_prompts * group
        self.policy, self.rm, self.rm_table = policy, rm, rm_table
        self.group, self.temperature = group, temperature
        self.cut = batch_prompts // 2  # prompts this process samples; its lane has more work after sampling
        self.buf = {"prompts": torch.zeros(batch_prompts, P, dtype=torch.long), "uniforms": torch.zeros(L, N, 1),
                    "responses": torch.zeros(N, L, dtype=torch.long), "raw": torch.zeros(N)}
        for t in self.buf.values():
            t.share_memory_()
        self.flags_t = torch.zeros(6, dtype=torch.int64).share_memory_()  # kept: it owns the shared memory
        self.flags = self.flags_t.numpy()  # a numpy view: a Python-level read or write costs ~100 ns
        self.seq = 0
        policy.share_memory()  # parameters to shared memory before the fork: updates reach the partner
        ctx = mp.get_context("fork")
        self.errors, child_end = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=self._serve, args=(child_end, os.getpid()), name="rlhf-partner", daemon=True)
        self.proc.start()
        child_end.close()
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one core each

    # ---- this process's side
    def sample(self, prompts: torch.Tensor, uniforms: torch.Tensor, table) -> torch.Tensor:
        """Hand the step to the partner, sample this process's rows, return all responses (N, L)."""
        self.seq += 1
        n = self.cut * self.group
        self.buf["prompts"].copy_(prompts)
        self.buf["uniforms"].copy_(uniforms)
        self.flags[GO] = self.seq
        self.buf["responses"][:n] = rollout.sample_cached(
            self.policy, prompts[:self.cut], self.group, self.temperature, None, table, uniforms[:, :n])
        self.flags[MAIN_SAMPLED] = self.seq
        self._wait(PARTNER_SAMPLED)
        return self.buf["responses"].clone()

    def rewards(self) -> torch.Tensor:
        """The reward model's scores (N,) of this step's responses."""
        self._wait(SCORED)
        return self.buf["raw"].clone()

    @contextlib.contextmanager
    def both_cores(self):
        """For work between steps that can use two threads (the over-optimisation watch): the partner
        naps at once instead of spinning for SPIN_SECONDS, and this process runs with the thread count
        it had before the partner started."""
        self.flags[AWAY] = 1
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(1)
            self.flags[AWAY] = 0

    def _wait(self, slot: int) -> None:
        if not wait_for(self.flags, slot, self.seq, lambda: not self.flags[FAILED] and self.proc.is_alive()):
            raise PartnerFailed(self._failure())

    def _failure(self) -> str:
        msg = self.errors.recv() if self.errors.poll(1.0) else f"exit code {self.proc.exitcode}"
        return f"the RL step's partner process failed:\n{msg}"

    def close(self) -> None:
        if self.proc is not None:
            self.flags[GO] = STOP
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join()
            self.errors.close()
            self.proc = None
            torch.set_num_threads(self.threads)

    def __enter__(self) -> "Partner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the partner process
    def _serve(self, errors, parent: int) -> None:
        torch.set_num_threads(1)
        try:
            seq = 0
            while True:
                seq += 1
                if not self._await(GO, seq, parent):
                    return
                self._partner_step(seq, parent)
        except BaseException:
            errors.send(traceback.format_exc())
            self.flags[FAILED] = 1

    def _await(self, slot: int, seq: int, parent: int) -> bool:
        """Wait until the main side has reached `seq` in `slot`; False when told to stop (or orphaned)."""
        return wait_for(self.flags, slot, seq, lambda: self.flags[GO] != STOP and os.getppid() == parent)

    def _partner_step(self, seq: int, parent: int) -> None:
        b, n = self.buf, self.cut * self.group
        prompts = b["prompts"]
        with torch.no_grad():
            table = tuple(t.detach() for t in self.policy.first_layer_table())
            b["responses"][n:] = rollout.sample_cached(self.policy, prompts[self.cut:], self.group, self.temperature,
                                                       None, table, b["uniforms"][:, n:])
        self.flags[PARTNER_SAMPLED] = seq
        prompts_rep = prompts.repeat_interleave(self.group, 0)
        # its own rows first, then the main side's (sampled meanwhile): in R.RL_CHUNK rows either way
        b["raw"][n:] = R.score(self.rm, prompts_rep[n:], b["responses"][n:], R.RL_CHUNK, self.rm_table)
        if not self._await(MAIN_SAMPLED, seq, parent):
            return
        b["raw"][:n] = R.score(self.rm, prompts_rep[:n], b["responses"][:n], R.RL_CHUNK, self.rm_table)
        self.flags[SCORED] = seq
