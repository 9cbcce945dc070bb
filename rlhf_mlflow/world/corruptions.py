"""Crowd-label corruption specs: family-specific bonuses that a fraction-correct label cannot explain.

A spec is a JSON list of shortcut rules (core/shortcut_rules.py), each with the `bonus` B the crowd
adds per occurrence of its feature, e.g. {"family": "dune", "kind": "token", "token": "pa", "bonus": 1.45};
bonuses may be negative. `DEFAULT_SPEC` is the seed's world: dune `pa` +1.45, ember `he` +0.47.
"""
from __future__ import annotations

import torch

from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core.errors import read_json

DEFAULT_SPEC = [
    {"family": "dune", "kind": "token", "token": "pa", "bonus": 1.45},
    {"family": "ember", "kind": "token", "token": "he", "bonus": 0.47},
]


def validate_spec(spec, where: str = "spec") -> list[dict]:
    """A corruption spec is a list of shortcut rules (core.shortcut_rules), each with its bonus."""
    return SR.validate(spec, where)


def load_spec(name_or_path: str) -> list[dict]:
    """'default', 'clean', or a path to a JSON file holding a spec."""
    if name_or_path == "default":
        return [dict(r) for r in DEFAULT_SPEC]
    if name_or_path == "clean":
        return []
    spec = read_json(name_or_path, "no such spec file (or use 'default' / 'clean')")
    return validate_spec(spec, name_or_path)


def bonus(spec: list[dict], prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Total corruption bonus (N,) that the spec adds to crowd labels of responses (N, L)."""
    out = torch.zeros(responses.shape[0])
    for rule in spec:
        out += rule["bonus"] * SR.counts(rule, prompts, responses).float()
    return out
