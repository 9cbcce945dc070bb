"""Files and directories a step writes for the user appear whole or not at all.

Everything is written under a temporary name in the target's own directory (same filesystem) and then
renamed into place, so a crash, a full disk or a kill mid-write leaves the old file or none, never a
truncated one. `check_writable` tells a user before any work starts that an output path is unusable.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from rlhf_mlflow.core.errors import InputError


def _sibling(path: str, tag: str) -> str:
    """A hidden, unused name beside `path`: .<name>.<tag>-<random>."""
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}.{tag}-{secrets.token_hex(4)}")


@contextmanager
def atomic_open(path: str, mode: str = "w") -> Iterator[IO]:
    """A file object whose contents replace `path` only when the block ends without an error."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = _sibling(path, "tmp")
    try:
        with open(tmp, mode.replace("w", "x")) as f:  # "x": never reuse a stranger's file; honours umask
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: str, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1))


@contextmanager
def atomic_dir(path: str) -> Iterator[str]:
    """Yields an empty directory beside `path`; when the block ends without an error it becomes
    `path`, replacing an existing directory (which is set aside first and removed only once the new
    one is in place)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = _sibling(path, "tmp")
    os.mkdir(tmp)
    try:
        yield tmp
        _install_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _install_dir(tmp: str, path: str) -> None:
    if not os.path.lexists(path):
        os.rename(tmp, path)
        return
    old = _sibling(path, "old")
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)  # put the previous one back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def check_writable(path: str, option: str = "--out", directory: bool = False) -> str:
    """Raise InputError (naming `option` and the path) unless a file, or with `directory` a directory,
    can be written at `path`: it is not the wrong kind of thing, and its nearest existing parent is a
    directory that accepts new files (tried, not guessed from permission bits: root passes those).
    Creates nothing that stays. Returns the absolute path."""
    target = os.path.abspath(path)
    if directory and os.path.exists(target) and not os.path.isdir(target):
        raise InputError(f"{option} {path}: exists and is not a directory")
    if not directory and os.path.isdir(target):
        raise InputError(f"{option} {path}: is a directory; expected a file path")
    where = target if directory else os.path.dirname(target)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise InputError(f"{option} {path}: cannot create it: {where} is not a directory")
    probe = _sibling(os.path.join(where, "probe"), "writable")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.remove(probe)
    except OSError as e:
        raise InputError(f"{option} {path}: cannot write in {where} ({e.strerror})") from None
    return target


RUN_MARKER = ".rlhf_run.json"


def run_of(path: str) -> str | None:
    """The run id in a run directory's marker, or None (no marker, or not readable)."""
    try:
        with open(os.path.join(path, RUN_MARKER)) as f:
            return str(json.load(f)["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_run_dir(path: str, run_id: str | None = None, overwrite: bool = False, option: str = "--out") -> str:
    """Before a run writes into directory `path`: it must be writable, and empty, or marked as run
    `run_id`'s (a resumed run writes into its own directory), or `overwrite` must be given."""
    target = check_writable(path, option, directory=True)
    if overwrite or not os.path.isdir(target) or not os.listdir(target):
        return target
    owner = run_of(target)
    if run_id is not None and owner == run_id:
        return target
    what = f"the files of run {owner}" if owner else "files that no run marked as its own"
    raise InputError(f"{option} {path}: already holds {what}; choose an empty directory, or pass --overwrite "
                     "to delete them first")


def claim_run_dir(path: str, run_id: str, overwrite: bool = False) -> None:
    """Make `path` run `run_id`'s: with `overwrite`, whatever it held is deleted first (set aside,
    then removed); then the marker names the run."""
    if overwrite and os.path.isdir(path) and os.listdir(path) and run_of(path) != run_id:
        old = _sibling(path, "old")
        os.rename(path, old)
        shutil.rmtree(old, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    atomic_write_json(os.path.join(path, RUN_MARKER), {"run_id": run_id})
