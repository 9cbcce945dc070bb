"""Shared helpers for the frozen component configs: validation, overrides and JSON round trips."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from rlhf_mlflow.core.errors import InputError

MAX_SEED = 2 ** 32 - 1
"""The largest seed any step takes (numpy's legacy limit): torch's and numpy's generators both accept it,
with room for the small offsets steps add to derive their streams."""


def check_range(name: str, value, lo=None, hi=None, integer: bool = False, lo_open: bool = False) -> None:
    """Raise InputError naming the field and its valid range unless lo <= value <= hi."""
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    ok = ok and not isinstance(value, bool) and (integer or math.isfinite(value))
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        lo_s = "-inf" if lo is None else str(lo)
        rng = f"{'(' if lo_open else '['}{lo_s}, {'inf)' if hi is None else f'{hi}]'}"
        raise InputError(f"{name} must be {kind} in {rng}, got {value!r}")


def check_seed(name: str, value) -> None:
    """check_range for a seed: an integer in [0, MAX_SEED]."""
    check_range(name, value, 0, MAX_SEED, integer=True)


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def from_dict(cls, d: dict, where: str = "config"):
    """Build a config dataclass from a dict, rejecting unknown keys with the list of valid ones."""
    names = field_names(cls)
    unknown = [k for k in d if k not in names]
    if unknown:
        raise InputError(f"{where}: unknown config key {unknown[0]!r}; valid keys are {names}")
    return cls(**d)


def parse_override(text: str) -> tuple[str, Any]:
    """'key=value' -> (key, value); the value is parsed as JSON when it is JSON, else kept as a string."""
    if "=" not in text:
        raise InputError(f"override {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw
    except RecursionError:
        raise InputError(f"override {key.strip()!r}: JSON nested too deeply to read") from None
    return key.strip(), value


def field_docs(cls) -> dict[str, str]:
    """{field: the docstring written under it} of a dataclass: the one place a knob is documented."""
    import ast
    import inspect
    import textwrap
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    out = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                and isinstance(b.value.value, str)):
            out[a.target.id] = " ".join(b.value.value.split())
    return out
