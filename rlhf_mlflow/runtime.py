"""Process-level settings: torch thread count from the environment."""
from __future__ import annotations

import os

import torch


def configure_threads() -> int:
    """Set torch's intra-op threads from RLHF_THREADS, else OMP_NUM_THREADS, else min(2, cores)."""
    raw = os.environ.get("RLHF_THREADS") or os.environ.get("OMP_NUM_THREADS")
    n = int(raw) if raw and raw.isdigit() and int(raw) > 0 else min(2, os.cpu_count() or 1)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
