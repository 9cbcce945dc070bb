"""Where a step may write (`--out`), checked before any run starts: never onto or over a file the
command reads, the tracking store's files or a world, and always somewhere writable.

A directory is written by the one output rule (core/files.py: check_out_dir, then claim_out_dir or
atomic_dir with the run as owner), whichever command writes it: new or empty; or this run's own (a
resume); or, with --overwrite, another run's of the same command, as its marker says. Files no
marker claims, another command's output, a world and a store are refused, --overwrite or not.
"""
from __future__ import annotations

from rlhf_mlflow.core import files as F
from rlhf_mlflow.tracking.store_paths import store_paths


def check_out(out: str, reads: dict[str, str | None] | None = None, option: str = "--out") -> str:
    """`out`, a file, leaves every input in `reads` (name -> path), the store and every world alone,
    and can be written. Returns the absolute path."""
    F.check_out_is_free(out, reads, store_paths(), option)
    return F.check_writable(out, option)


def check_out_dir(out: str, command: str, reads: dict[str, str | None] | None = None, run_id: str | None = None,
                  overwrite: bool = False, option: str = "--out") -> str:
    """`out`, the directory `command` writes (its step's name), leaves every input, the store and every
    world alone (build_world's may be the world it wrote), and the one output rule lets `run_id` (None:
    a new run) write there, replacing another run's of `command` with `overwrite`. Returns the
    absolute path."""
    F.check_out_is_free(out, reads, store_paths(), option, may_be_world=command == F.BUILD_WORLD)
    return F.check_out_dir(out, command, run_id, overwrite, option)
