"""Files and directories a step writes for the user appear whole or not at all.

Everything is written under a temporary name in the target's own directory (same filesystem) and then
renamed into place, so a crash, a full disk or a kill mid-write leaves the old file or none, never a
truncated one. `check_writable` tells a user before any work starts that an output path is unusable;
`check_out_is_free`, that it would overwrite an input, a tracking store or a world. The one output
rule for every command that writes a directory: `check_out_dir` before any run, then `claim_out_dir`
(a directory written as it goes) or `atomic_dir(path, owner)` (one written whole).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import LAYOUT, is_world


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
def atomic_dir(path: str, owner: "Owner | None" = None) -> Iterator[str]:
    """Yields an empty directory beside `path`; when the block ends without an error it becomes
    `path`, replacing an existing directory (which is set aside first and removed only once the new
    one is in place). With `owner`, `path` is a command's output (the one output rule below): the new
    directory carries its marker, and replaces only a directory that command's runs marked."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = _sibling(path, "tmp")
    os.mkdir(tmp)
    try:
        yield tmp
        if owner is not None:
            _stage_owned(tmp, path, owner)
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
"""What a command writes into its output directory: {"command": its step, "run_id": its MLflow run}."""
MAIN_STATE = "main_state.json"
"""main's journal (steps/main/resume.py), which is its marker: it names main's runs, the latest last."""
BUILD_WORLD = "build_world"
"""The builder's marker is the world's manifest.json; a world's "run" is its content hash."""


@dataclass(frozen=True)
class Owner:
    """Who wrote a directory: a command (its step's name) and its run: an MLflow run id, a world's hash
    for build_world, None where no MLflow run wrote it (the portable repair)."""
    command: str
    run_id: str | None = None

    def describe(self) -> str:
        if self.command == BUILD_WORLD:
            return f"world {self.run_id}"
        return f"the files of {self.command} run {self.run_id}" if self.run_id else \
            f"the files of a {self.command} without an MLflow run"


def owner_of(path: str) -> Owner | None:
    """Who wrote directory `path`, as its marker says: RUN_MARKER (one written before markers named
    their command is a train_rl run's), main's MAIN_STATE, or a world's manifest as this project's
    builder writes it. None when no marker claims it (or its marker cannot be read)."""
    marker = _json_or_none(os.path.join(path, RUN_MARKER))
    if isinstance(marker, dict) and "run_id" in marker:
        command, run = marker.get("command", "train_rl"), marker["run_id"]
        ok = isinstance(command, str) and (run is None or isinstance(run, str))
        return Owner(command, run) if ok else None
    state = _json_or_none(os.path.join(path, MAIN_STATE))
    if isinstance(state, dict) and isinstance(state.get("runs"), list):
        return Owner("main", str(state["runs"][-1]) if state["runs"] else None)
    manifest = _json_or_none(os.path.join(path, LAYOUT["manifest"])) if is_world(path) else None
    if isinstance(manifest, dict) and {"world_hash", "builder_version"} <= manifest.keys():
        return Owner(BUILD_WORLD, str(manifest["world_hash"]))
    return None


def _json_or_none(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError):
        return None


def check_out_dir(path: str, command: str, run_id: str | None = None, overwrite: bool = False,
                  option: str = "--out") -> str:
    """The one rule for a directory a command writes (steps/outputs.py adds the store, the worlds and
    the command's inputs). `path` must be writable, and new or empty; or this run's own (its marker
    names `command` and `run_id`: a resume, or for build_world the world asked for); or, with
    `overwrite`, another run's of `command` (its marker says so) holding no world, no tracking store
    and not the current directory. Files no marker claims, and another command's directory, are
    refused even with `overwrite`. Returns the absolute path."""
    target = check_writable(path, option, directory=True)
    if not os.path.isdir(target) or not os.listdir(target):
        return target
    owner = owner_of(target)
    if owner is None:
        raise InputError(f"{option} {path}: already holds files that no run marked as its own (no {RUN_MARKER}); "
                         "a command writes only into a new or empty directory or one its own runs marked, and "
                         "--overwrite deletes only such a directory: choose another")
    if owner.command != command:
        raise InputError(f"{option} {path}: holds {owner.describe()}, not a {command} run's; choose another "
                         f"directory (--overwrite replaces only a {command} run's)")
    if run_id is not None and owner.run_id == run_id:
        return target
    if not overwrite:
        asked = ", not the one asked for" if command == BUILD_WORLD else ""
        raise InputError(f"{option} {path}: already holds {owner.describe()}{asked}; choose a new or empty "
                         "directory, or pass --overwrite to replace it")
    _check_deletable(path, owner, option)
    return target


def claim_out_dir(path: str, owner: Owner, overwrite: bool = False, mark: bool = True) -> None:
    """Make directory `path` `owner`'s, as check_out_dir allowed (asked again: the directory may have
    changed since): another run's of the same command is deleted first with `overwrite` (set aside,
    then removed); then, with `mark`, RUN_MARKER names the owner (main's marker is its own state file)."""
    found = owner_of(path) if os.path.isdir(path) and os.listdir(path) else owner
    if found != owner:
        if not overwrite or found is None or found.command != owner.command:
            raise InputError(f"--out {path}: holds files that no {owner.command} run marked as its own (it changed "
                             "since it was checked); not deleting them")
        _check_deletable(path, found, "--out")
        _discard(path)
    os.makedirs(path, exist_ok=True)
    if mark:
        atomic_write_json(os.path.join(path, RUN_MARKER), {"command": owner.command, "run_id": owner.run_id})


def _stage_owned(tmp: str, path: str, owner: Owner) -> None:
    """atomic_dir's part of the rule: the staged directory carries `owner`'s marker (written here unless
    the block wrote its own, a world's manifest), and what it replaces is that command's output."""
    if owner_of(tmp) is None:
        atomic_write_json(os.path.join(tmp, RUN_MARKER), {"command": owner.command, "run_id": owner.run_id})
    if owner_of(tmp) != owner:
        raise RuntimeError(f"{path}: the directory written is marked {owner_of(tmp)}, not {owner}")
    if os.path.isdir(path) and os.listdir(path):
        found = owner_of(path)
        if found is None or found.command != owner.command:
            raise InputError(f"--out {path}: holds files that no {owner.command} run marked as its own (it changed "
                             "since it was checked); not replacing them")
        _check_deletable(path, found, "--out")


def _check_deletable(path: str, owner: Owner, option: str) -> None:
    """Replacing directory `path` deletes neither the current directory nor a world or a tracking store
    below it (a world's own directory aside, for its builder)."""
    target = os.path.realpath(path)
    if _within(os.path.realpath(os.getcwd()), target):
        raise InputError(f"{option} {path} --overwrite would delete the current directory: choose another directory")
    for dirpath, dirs, names in os.walk(target):
        if dirpath != target or owner.command != BUILD_WORLD:
            if is_world(dirpath):
                raise InputError(f"{option} {path} --overwrite would delete the world {dirpath}: choose another "
                                 "directory")
        stores = [n for n in dirs if n in ("mlruns", "mlartifacts")] + [n for n in names if _is_sqlite(os.path.join(dirpath, n))]
        if stores:
            raise InputError(f"{option} {path} --overwrite would delete the tracking store "
                             f"{os.path.join(dirpath, stores[0])}: choose another directory")
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]


def _is_sqlite(path: str) -> bool:
    if not os.path.isfile(path) or os.path.islink(path):  # never open a FIFO (it would block)
        return False
    with open(path, "rb") as f:
        return f.read(16) == b"SQLite format 3\0"


def _discard(path: str) -> None:
    old = _sibling(path, "old")
    os.rename(path, old)
    shutil.rmtree(old, ignore_errors=True)


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
