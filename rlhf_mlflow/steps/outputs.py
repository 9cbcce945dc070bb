"""Where a step may write (`--out`), checked before any run starts: never onto or over a file the
command reads, the tracking store's files or a world, and always somewhere writable; a run directory
is empty, this run's, or (with --overwrite) another run's marked one (core/files.py)."""
from __future__ import annotations

from rlhf_mlflow.core import files as F
from rlhf_mlflow.tracking.store_paths import store_paths


def check_out(out: str, reads: dict[str, str | None] | None = None, option: str = "--out",
              directory: bool = False) -> str:
    """`out` leaves every input in `reads` (name -> path), the store and every world alone, and a file
    (or with `directory` a directory) can be written there. Returns the absolute path."""
    F.check_out_is_free(out, reads, store_paths(), option)
    return F.check_writable(out, option, directory=directory)


def check_run_out(out: str, reads: dict[str, str | None] | None = None, overwrite: bool = False,
                  run_id: str | None = None, option: str = "--out") -> str:
    """As check_out for a run directory, which must also be free for this run (files.check_run_dir)."""
    F.check_out_is_free(out, reads, store_paths(), option)
    return F.check_run_dir(out, run_id=run_id, overwrite=overwrite, option=option)
