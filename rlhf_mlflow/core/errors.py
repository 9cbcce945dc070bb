"""Exceptions raised for bad user input, and the reading of JSON text such that every way a file can
be malformed (bytes that are not UTF-8, text that is not JSON, nesting too deep to read, a field of
the wrong type) is one InputError naming the file and line; the CLI turns it into one error line."""
from __future__ import annotations

import json
import math
import os
from typing import Any


class InputError(ValueError):
    """Bad input from the user: a file, a record, a config key or a checkpoint.

    The message names the offending file and line, or the key and its valid values.
    """


class GateError(InputError):
    """The release gate cannot decide now: its lock is held by another release, or was lost."""


MAX_DEPTH = 64  # no file this pipeline reads nests deeper than a few levels

TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "true/false", int: "an integer",
              float: "a number", type(None): "null"}
KINDS = {"a string": (str,), "an integer": (int,), "a number": (int, float), "a finite number": (int, float),
         "a string or an integer": (str, int), "an object": (dict,), "a list": (list,), "true/false": (bool,)}


def read_text(path: str, missing: str = "file not found") -> str:
    """A file's UTF-8 text; InputError naming the file when it is missing, and the line and byte offset
    of the first byte that is not UTF-8."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: {missing}")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InputError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte offset "
                         f"{e.start})") from None


def parse_json(text: str, where: str, line: int | None = None) -> Any:
    """One JSON value read from file `where` (`line`: the line `text` is, for a JSON Lines row)."""
    at = where if line is None else f"{where}:{line}"
    too_deep = f"{at}: JSON nested more than {MAX_DEPTH} levels deep (no input of this pipeline nests so deep)"
    if text.count("[") + text.count("{") > MAX_DEPTH and _bracket_depth(text) > MAX_DEPTH:
        raise InputError(too_deep)  # before json.loads: its C decoder recurses, and its RecursionError leaks
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}:{e.lineno if line is None else line}: malformed JSON ({e.msg} at column "
                         f"{e.colno})") from None
    except RecursionError:
        raise InputError(too_deep) from None
    if text.count("[") + text.count("{") > MAX_DEPTH and nesting(value) > MAX_DEPTH:
        raise InputError(too_deep)
    return value


def _bracket_depth(text: str) -> int:
    """The deepest [ / { nesting of JSON text outside its strings, scanned without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def read_json(path: str, missing: str = "file not found") -> Any:
    """Parse a JSON file; a missing file or malformed content raises InputError naming the file (and line)."""
    return parse_json(read_text(path, missing), path)


def nesting(value: Any) -> int:
    """How many lists/objects deep `value` goes, counted without recursion (up to MAX_DEPTH + 1)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if d <= MAX_DEPTH:
                stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def require(value: Any, kind: str, where: str, field: str) -> Any:
    """`value`, or InputError "where: field 'id' must be a string, got a list [1]"; kind: a KINDS key."""
    ok = isinstance(value, KINDS[kind]) and (kind == "true/false" or not isinstance(value, bool))
    if ok and kind == "a finite number":
        ok = math.isfinite(value)
    if not ok:
        raise InputError(f"{where}: field {field!r} must be {kind}, got {described(value)}")
    return value


def described(value: Any, limit: int = 60) -> str:
    """A value for an error line: its JSON type, and its text when that is short."""
    name = TYPE_NAMES.get(type(value), type(value).__name__)
    if nesting(value) > 3:
        return f"{name} nested {nesting(value)} levels deep"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return name
    return f"{name} {text}" if len(text) <= limit else f"{name} {text[:limit]}..."
