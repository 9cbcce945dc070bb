"""Running several train_rl runs as one batch (batched.py): how many (RLHF_BATCH_RUNS) and the threads
that carry them, one per run, with an interrupt handed to every member."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.training.batched import Batch, Seat

BATCH_ENV = "RLHF_BATCH_RUNS"
DEFAULT_BATCH_RUNS = 1
"""Runs per batch where RLHF_BATCH_RUNS does not say (docs/PERFORMANCE.md has the measurements)."""


def batch_runs() -> int:
    """How many runs train together in one batch: RLHF_BATCH_RUNS (a positive integer), else the default."""
    raw = os.environ.get(BATCH_ENV, "").strip()
    if not raw:
        return DEFAULT_BATCH_RUNS
    if not raw.isdigit() or int(raw) < 1:
        raise InputError(f"{BATCH_ENV}={raw!r}: expected a positive integer (runs trained together in one process)")
    return int(raw)


def run_together(calls: list[Callable[[Seat], object]]) -> list[object]:
    """Each call in its own thread with a seat of one Batch (it passes the seat to train_rl); returns each
    call's result, or the exception it raised, in order. An interrupt here (Ctrl-C, or SIGTERM under
    core/process.handle_signals) aborts the batch: every member raises it at its next step (its MLflow
    run ends KILLED), and it is raised again here once they have all stopped."""
    batch = Batch(len(calls))
    out: list[object] = [None] * len(calls)

    def member(k: int, seat: Seat) -> None:
        try:
            out[k] = calls[k](seat)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out[k] = e
        finally:
            seat.release()
    threads = [threading.Thread(target=member, args=(k, seat), name=f"rlhf-member-{k}")
               for k, seat in enumerate(batch.seats())]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # short waits: the main thread must stay able to take a signal
    except BaseException as e:
        batch.abort(e)
        for t in threads:
            t.join()
        raise
    return out


def run_all(calls: list[Callable[[Seat], object]]) -> list[object]:
    """run_together, each call's result in order; a call that failed fails the whole, with the first
    failure raised once every member has finished."""
    out = run_together(calls)
    failed = [r for r in out if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return out
