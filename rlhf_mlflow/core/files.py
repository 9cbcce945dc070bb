"""Files and directories a step writes for the user appear whole or not at all.

Everything is written under a temporary name in the target's own directory (same filesystem) and then
renamed into place, so a crash, a full disk or a kill mid-write leaves the old file or none, never a
truncated one. `check_writable` tells a user before any work starts that an output path is unusable;
`check_out_is_free`, that it would overwrite an input, a tracking store or a world; `check_run_dir`,
that it holds files no run of this project marked as its own (which --overwrite never deletes).
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
from rlhf_mlflow.core.world_paths import is_world


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
    `run_id`'s (a resumed run writes into its own directory), or marked as another run's and
    `overwrite` given. A directory no run marked (.rlhf_run.json) is never deleted, not even with
    `overwrite`, nor one that holds a world."""
    target = check_writable(path, option, directory=True)
    if not os.path.isdir(target) or not os.listdir(target):
        return target
    owner = run_of(target)
    if owner is None:
        raise InputError(f"{option} {path}: already holds files that no run marked as its own (no {RUN_MARKER}); "
                         "--overwrite deletes only a directory a run of this project wrote: choose an empty directory")
    if run_id is not None and owner == run_id:
        return target
    if not overwrite:
        raise InputError(f"{option} {path}: already holds the files of run {owner}; choose an empty directory, or "
                         "pass --overwrite to delete them first")
    nested = _world_under(target)
    if nested:
        raise InputError(f"{option} {path} --overwrite would delete the world {nested}: choose another directory")
    return target


def claim_run_dir(path: str, run_id: str, overwrite: bool = False) -> None:
    """Make `path` run `run_id`'s: with `overwrite`, what another run of this project wrote there (its
    marker says so) is deleted first (set aside, then removed); then the marker names the run."""
    if overwrite and os.path.isdir(path) and os.listdir(path) and run_of(path) != run_id:
        if run_of(path) is None:  # check_run_dir refused it; the directory changed since
            raise InputError(f"--out {path}: holds files that no run marked as its own; not deleting them")
        old = _sibling(path, "old")
        os.rename(path, old)
        shutil.rmtree(old, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    atomic_write_json(os.path.join(path, RUN_MARKER), {"run_id": run_id})


def _world_under(root: str) -> str | None:
    """The first world directory at or below `root` (a run directory: a small tree), or None."""
    for dirpath, dirs, _ in os.walk(root):
        if is_world(dirpath):
            return dirpath
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]
    return None


def _within(path: str, root: str) -> bool:
    """`path` is `root` or lies inside it (both resolved)."""
    return path == root or path.startswith(os.path.join(root, ""))


def check_out_is_free(out: str, reads: dict[str, str | None] | None = None,
                      protected: list[tuple[str, str]] = (), option: str = "--out", may_be_world: bool = False) -> None:
    """Raise InputError (one line) if writing at `out` could overwrite or delete something the command
    must leave alone: `out` is or contains a path the command reads (`reads`: name -> path), is,
    contains or lies inside a `protected` path ((what, path): a tracking store's database or artifact
    root), or is or lies inside a world directory (`may_be_world`: `out` itself may be one, for the
    builder, which decides itself). Paths are compared resolved, symlinks followed."""
    target = os.path.realpath(out)
    for name, path in (reads or {}).items():
        if path and os.path.exists(path):
            real = os.path.realpath(path)
            if _within(real, target):
                how = "is" if real == target else "contains"
                raise InputError(f"{option} {out}: {how} {name} {path}, which this command reads; choose another path")
    for what, path in protected:
        real = os.path.realpath(path)
        if _within(real, target) or _within(target, real):
            how = "is" if real == target else "contains" if _within(real, target) else "lies inside"
            raise InputError(f"{option} {out}: {how} {what} {path}; choose a path outside it")
    where = target if not may_be_world else os.path.dirname(target)
    while True:
        if is_world(where):
            how = "is" if where == target else "lies inside"
            raise InputError(f"{option} {out}: {how} the world {where}; choose a path outside every world")
        if where == os.path.dirname(where):
            return
        where = os.path.dirname(where)
