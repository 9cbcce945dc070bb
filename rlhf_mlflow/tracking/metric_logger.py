"""Metric points logged the way a training loop can afford: buffered, handed to MLflow's asynchronous
logger in batches, safe with several runs in one process (batched runs, training/batched.py).

MLflow's asynchronous queue is one per process, and its flush shuts the queue's thread pools down until
the next batch re-opens them: a batch handed in by one thread while another flushes fails with "cannot
schedule new futures after shutdown". Every hand-in and flush here holds ASYNC_LOCK.
"""
from __future__ import annotations

import threading
import time

import mlflow

from rlhf_mlflow.tracking.metric_bounds import checked

ASYNC_LOCK = threading.Lock()


def flush_async() -> None:
    """Wait until every metric point handed to MLflow's asynchronous logger is stored."""
    with ASYNC_LOCK:
        mlflow.flush_async_logging()


class MetricLogger:
    """An `on_log(step, metrics)` callback that buffers metric points and hands them to MLflow's
    asynchronous logger in one batch at most every `flush_seconds` (and on `flush()`), so the
    training loop neither waits on the store (~20 ms a synchronous call on sqlite) nor pays a
    store round trip per report. `stored` ({key: last step already in the store}) drops points a
    resumed run would log a second time; a non-finite or absurd value is dropped (metric_bounds)."""

    def __init__(self, prefix: str = "", flush_seconds: float = 10.0, stored: dict[str, int] | None = None):
        self.prefix = prefix
        self.flush_seconds = flush_seconds
        self.stored = stored or {}
        self._last = time.monotonic()
        self._buffer: list = []

    def __call__(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric
        ts, named = int(1000 * time.time()), checked({self.prefix + k: v for k, v in metrics.items()})
        self._buffer += [Metric(k, v, ts, step) for k, v in named.items() if step > self.stored.get(k, -1)]
        if time.monotonic() - self._last >= self.flush_seconds:
            self.flush()

    def flush(self, synchronous: bool = False) -> None:
        """Hand the buffer to MLflow; `synchronous` waits until every point so far is stored."""
        if self._buffer:
            run = mlflow.active_run()
            with ASYNC_LOCK:
                mlflow.MlflowClient().log_batch(run.info.run_id, metrics=self._buffer, synchronous=False)
            self._buffer = []
        if synchronous:
            flush_async()
        self._last = time.monotonic()


def stored_steps(run_id: str) -> dict[str, int]:
    """{metric key: the last step stored} for a run (what a resumed run must not log again)."""
    client = mlflow.MlflowClient()
    keys = client.get_run(run_id).data.metrics
    return {k: max(m.step for m in client.get_metric_history(run_id, k)) for k in keys}
