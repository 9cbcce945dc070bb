"""Content hashes: a file's sha256, and a directory's over every file in it.

A directory's hash covers each file's relative path and bytes, at every depth (a repaired reward
model's repair.json and ensemble/ included: they change what certify does with it), so a copy is the
same directory exactly when every file is. The run marker a command leaves in its output directory
(`.rlhf_run.json`: who wrote it, not what it holds) is not content.
"""
from __future__ import annotations

import hashlib
import os

from rlhf_mlflow.core.errors import InputError

RUN_MARKER = ".rlhf_run.json"
MAX_FILES = 2000
"""A directory hashed as one input holds at most this many files (a checkpoint holds a handful)."""


def files_under(root: str) -> list[str]:
    """Every file below `root`, as sorted relative paths with `/` separators."""
    out = []
    for here, dirs, names in os.walk(root):
        dirs.sort()
        rel = os.path.relpath(here, root)
        out += [name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}" for name in names]
    return sorted(out)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dir_files(root: str) -> dict[str, str]:
    """{relative path: sha256} of every file under directory `root` but its run marker; InputError for
    a directory far larger than any checkpoint or world item."""
    rels = [r for r in files_under(root) if r != RUN_MARKER]
    if len(rels) > MAX_FILES:
        raise InputError(f"{root}: holds {len(rels)} files, more than the {MAX_FILES} an input directory may hold")
    return {rel: file_sha256(os.path.join(root, rel)) for rel in rels}


def digest_of(files: dict[str, str]) -> str:
    """One sha256 over a {relative path: sha256} map (order-free)."""
    h = hashlib.sha256()
    for rel, sha in sorted(files.items()):
        h.update(rel.encode() + b"\0" + sha.encode() + b"\n")
    return h.hexdigest()


def content_sha256(path: str) -> str:
    """sha256 of a file's bytes, or of a directory's every file (digest_of(dir_files(path)))."""
    if os.path.isfile(path):
        return file_sha256(path)
    return digest_of(dir_files(path))
