"""Crowd-label corruption specs: family-specific bonuses that a fraction-correct label cannot explain.

A spec is a JSON list of shortcut rules (core/shortcut_rules.py), each with the `bonus` B the crowd
adds per occurrence of its feature, e.g. {"family": "dune", "kind": "token", "token": "pa", "bonus": 1.45};
bonuses may be negative. `DEFAULT_SPEC` is the seed's world: dune `pa` +1.45, ember `he` +0.47.

A spec is bounded (validate_spec) so that the world it builds is one its own readers take: each bonus
within +-MAX_BONUS, and per family the most its rules could add to (or take from) one label together
(most_paid, over every possible response) within MAX_FAMILY_BONUS, so that every crowd label stays in
the crowd's plausible range (core/records.py LABEL_RANGES) whatever the responses.
"""
from __future__ import annotations

import torch

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError, read_json

DEFAULT_SPEC = [
    {"family": "dune", "kind": "token", "token": "pa", "bonus": 1.45},
    {"family": "ember", "kind": "token", "token": "he", "bonus": 0.47},
]


MAX_RULES = 64
"""Rules a spec may hold."""
MAX_BONUS = 2.0
"""The largest |bonus| per occurrence: the seed's is 1.45 (dune `pa`), ~1.4 as the QA sample's ridge fit reads it."""
MAX_FAMILY_BONUS = D.LABEL_RANGES[D.CROWD][1] - 4.0
"""What a family's rules may add to (or take from) one crowd label at most: the crowd range less room for
a quality in [0, 1] and the crowd's noise (16: the default spec's dune rule reaches 8 x 1.45 = 11.6)."""


def most_paid(rules: list[dict]) -> float:
    """The most one family's rules can add to or take from one crowd label: the largest |sum of bonus x
    occurrences| over every response of RESP_LEN tokens (by dynamic programming over positions; a
    conditional rule counts as if its prompt condition held, so this is an upper bound)."""
    index = {t: i for i, t in enumerate(V.CONTENT)}
    most = 0.0
    for sign in (1.0, -1.0):
        token = torch.zeros(V.N_CONTENT, dtype=torch.float64)                 # paid per position holding it
        pair = torch.zeros(V.N_CONTENT, V.N_CONTENT, dtype=torch.float64)    # (previous, next)
        for r in rules:
            if r["kind"] == "pair":
                pair[index[r["tokens"][0]], index[r["tokens"][1]]] += sign * r["bonus"]
            else:
                token[index[r["token"]]] += sign * r["bonus"]
        best = token.clone()                                                  # best total ending in each token
        for _ in range(V.RESP_LEN - 1):
            best = token + (best[:, None] + pair).max(0).values
        most = max(most, float(best.max()))
    return most


def validate_spec(spec, where: str = "spec") -> list[dict]:
    """A corruption spec is a list of at most MAX_RULES shortcut rules (core.shortcut_rules), each with its
    bonus in [-MAX_BONUS, MAX_BONUS], a family's together paying at most MAX_FAMILY_BONUS on one label.
    InputError names `where` (the spec file), the rule and the field."""
    SR.validate(spec, where)
    if len(spec) > MAX_RULES:
        raise InputError(f"{where}: {len(spec)} rules; a spec holds at most {MAX_RULES}")
    for i, rule in enumerate(spec):
        if abs(rule["bonus"]) > MAX_BONUS:
            raise InputError(f"{where}[{i}]: 'bonus' must be a number in [-{MAX_BONUS:g}, {MAX_BONUS:g}] per "
                             f"occurrence (the seed's largest is 1.45), got {rule['bonus']!r}")
    for family in V.FAMILIES:
        total = most_paid([r for r in spec if r["family"] == family])
        if total > MAX_FAMILY_BONUS:
            raise InputError(f"{where}: family {family!r}: its rules' bonuses could move one crowd label by {total:g}; "
                             f"at most {MAX_FAMILY_BONUS:g} keeps crowd labels in {list(D.LABEL_RANGES[D.CROWD])}")
    return spec


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
