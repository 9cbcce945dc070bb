"""Exceptions raised for bad user input; the CLI turns them into one clear error line."""
import json
import os


class InputError(ValueError):
    """Bad input from the user: a file, a record, a config key or a checkpoint.

    The message names the offending file and line, or the key and its valid values.
    """


class GateError(InputError):
    """The release gate cannot decide now: its lock is held by another release, or was lost."""


def read_json(path: str, missing: str = "file not found"):
    """Parse a JSON file; a missing file or bad JSON raises InputError naming the file (and line)."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: {missing}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
