"""A training run's progress on stderr: a bar on a terminal, or a line every few seconds (workers, logs)."""
from __future__ import annotations

import sys
import time

from rlhf_mlflow.core.process import quiet


def training_progress(total: int, enabled: bool | float, start: int = 0, label: str = ""):
    """Progress on stderr, silent under --quiet: `enabled` True, a bar when attached to a terminal
    (nothing in logs); a number, a line every that many seconds (worker processes, logs)."""
    if quiet() or not enabled:
        return lambda step, metrics: None
    if enabled is not True:
        return _lines(total, float(enabled), label)
    if not sys.stderr.isatty():
        return lambda step, metrics: None
    from tqdm import tqdm
    bar = tqdm(total=total, initial=start, unit="step", file=sys.stderr)
    state = {"last": start}

    def update(step, metrics):
        if step is None:
            bar.close()
            return
        bar.update(step - state["last"])
        state["last"] = step
        bar.set_postfix(proxy=f"{metrics['proxy/balanced']:.3f}", kl=f"{metrics['kl/balanced']:.2f}")
    return update


def _lines(total: int, every: float, label: str):
    t0 = last = time.perf_counter()

    def update(step, metrics):
        nonlocal last
        now = time.perf_counter()
        if step is not None and now - last >= every:
            last = now
            print(f"  {label}: step {step}/{total} ({now - t0:.0f} s), proxy {metrics['proxy/balanced']:.3f}, "
                  f"kl {metrics['kl/balanced']:.2f}", file=sys.stderr, flush=True)
    return update
