"""Process-level settings: torch thread count from the environment, malloc behaviour, and a side
thread for one job at a time."""
from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

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


class SideThread:
    """A second thread for one job at a time beside the caller's own work, when torch has >= 2 threads.

    At the RL step's sizes most ops are below torch's intra-op grain, so a second core does more running
    half of the batch than splitting ops. While open, both threads use one intra-op thread (two OpenMP
    teams on two cores would spin against each other, badly so on a shared machine); closing restores
    the caller's count. With one thread, `submit` runs the job inline.
    """

    def __init__(self):
        self.threads = torch.get_num_threads()
        self.pool = None
        if self.threads >= 2:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="rlhf-side", initializer=torch.set_num_threads,
                                           initargs=(1,))
            torch.set_num_threads(1)

    @property
    def parallel(self) -> bool:
        return self.pool is not None

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        if self.pool is not None:
            return self.pool.submit(fn, *args, **kwargs)
        done: Future = Future()
        done.set_result(fn(*args, **kwargs))
        return done

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None
            torch.set_num_threads(self.threads)

    def __enter__(self) -> "SideThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
