"""Process-level settings (torch threads, malloc behaviour, signals) and a process's identity (host, pid and
start time), which tells a run whose process is gone from one still going."""
from __future__ import annotations

import ctypes
import os
import socket
import sys

import torch


def configure_threads() -> int:
    """Process set-up for torch work: intra-op threads from RLHF_THREADS, else OMP_NUM_THREADS, else
    min(2, cores); and malloc keeps freed memory (retain_freed_memory). Returns the thread count."""
    raw = os.environ.get("RLHF_THREADS") or os.environ.get("OMP_NUM_THREADS")
    n = int(raw) if raw and raw.isdigit() and int(raw) > 0 else min(2, os.cpu_count() or 1)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    retain_freed_memory()
    return n


def retain_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the OS.

    An RL step allocates and frees the same few-MB activations every time; by default glibc maps blocks
    that large fresh and trims the heap, so each step page-faults them in again (~500 faults a step,
    ~5% of its time). A no-op without glibc. Returns whether it applied.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 64 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 256 << 20))


def handle_signals() -> None:
    """SIGTERM (what `kill`, `timeout` and job schedulers send) raises KeyboardInterrupt, as Ctrl-C
    does, so a step's MLflow run is marked KILLED with its metrics flushed instead of being left
    RUNNING; both are recorded, so that an interrupt Python dropped is raised again
    (raise_if_interrupted). Only from the main thread (signal handlers can be set nowhere else)."""
    import signal
    import threading
    global _prior_hook
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where a caller chose another
            signal.signal(signal.SIGINT, _interrupt)
        if sys.unraisablehook is not _unraisable:
            _prior_hook, sys.unraisablehook = sys.unraisablehook, _unraisable


_received: list[int] = []
"""The signals _interrupt has turned into KeyboardInterrupt in this process."""
_prior_hook = None
"""The sys.unraisablehook handle_signals replaced."""


def _interrupt(signum, frame) -> None:
    _received.append(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def _unraisable(info) -> None:
    """sys.unraisablehook: quiet for a KeyboardInterrupt _interrupt raised where Python drops exceptions
    (raise_if_interrupted raises it again), every other case to the hook it replaced."""
    if isinstance(info.exc_value, KeyboardInterrupt) and _received:
        return
    (_prior_hook or sys.__unraisablehook__)(info)


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt again if a SIGTERM or Ctrl-C arrived. The handler's own raise can be lost: Python
    ignores (prints and drops) an exception raised inside a weakref or import-lock callback or a
    __del__, and the handler runs wherever the main thread is, there too (a train-rl run killed while
    a lazy import was finishing went on to FINISHED). Checked at every training step and where a step's
    run would end FINISHED, so an interrupt always ends the step as KILLED."""
    if _received:
        raise KeyboardInterrupt(f"signal {_received[-1]}")


killed_runs: list[tuple[str, str]] = []
"""(run id, step) of each run this process marked KILLED, in the order they ended (a nested step's run
before its parent's): what the interrupt message names."""


def note_killed(run_id: str, step: str) -> None:
    killed_runs.append((run_id, step))


def process_tags() -> dict[str, str]:
    """This process, as tags: host, pid and the pid's start time (pids are reused)."""
    return {"rlhf.host": socket.gethostname(), "rlhf.pid": str(os.getpid()),
            "rlhf.pid_start": str(pid_start(os.getpid()))}


def pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_state(tags: dict) -> str:
    """'alive', 'gone' or 'unknown' (another host, or no process tags) for a run's process tags."""
    if tags.get("rlhf.host") != socket.gethostname() or not tags.get("rlhf.pid", "").isdigit():
        return "unknown"
    start = pid_start(int(tags["rlhf.pid"]))
    return "alive" if start is not None and str(start) == tags.get("rlhf.pid_start") else "gone"


QUIET_ENV = "RLHF_MLFLOW_QUIET"
"""Set (to 1) by `rlhf-mlflow --quiet`; worker processes inherit it."""


def quiet() -> bool:
    """No progress on the console: results and errors only."""
    return os.environ.get(QUIET_ENV, "") not in ("", "0")
