"""Crowd-label corruption specs: family-specific bonuses that a fraction-correct label cannot explain.

A spec is a JSON list of rules, each one of
  {"family": F, "kind": "token", "token": T, "bonus": B}                         B per occurrence of T
  {"family": F, "kind": "pair", "tokens": [T1, T2], "bonus": B}                  B per adjacent T1 T2
  {"family": F, "kind": "conditional", "token": T, "attr": i, "value": v, "bonus": B}
                                                                                 B per T when attrs[i] == v
Bonuses may be negative. `DEFAULT_SPEC` is the seed's world: dune `pa` +1.45, ember `he` +0.47.
"""
from __future__ import annotations

import math

import torch

from .. import vocab as V
from ..errors import InputError, read_json

DEFAULT_SPEC = [
    {"family": "dune", "kind": "token", "token": "pa", "bonus": 1.45},
    {"family": "ember", "kind": "token", "token": "he", "bonus": 0.47},
]
KINDS = {"token": ("token",), "pair": ("tokens",), "conditional": ("token", "attr", "value")}


def validate_spec(spec, where: str = "spec") -> list[dict]:
    if not isinstance(spec, list):
        raise InputError(f"{where}: a corruption spec is a JSON list of rules, got {type(spec).__name__}")
    for i, rule in enumerate(spec):
        at = f"{where}[{i}]"
        if not isinstance(rule, dict):
            raise InputError(f"{at}: each rule is a JSON object")
        kind = rule.get("kind")
        if kind not in KINDS:
            raise InputError(f"{at}: unknown kind {kind!r}; valid kinds are {sorted(KINDS)}")
        missing = [k for k in ("family", "bonus") + KINDS[kind] if k not in rule]
        if missing:
            raise InputError(f"{at}: a {kind!r} rule needs keys {missing}")
        extra = set(rule) - {"family", "kind", "bonus"} - set(KINDS[kind])
        if extra:
            raise InputError(f"{at}: unknown keys {sorted(extra)} for kind {kind!r}")
        if rule["family"] not in V.FAMILIES:
            raise InputError(f"{at}: unknown family {rule['family']!r}; valid families are {V.FAMILIES}")
        toks = rule["tokens"] if kind == "pair" else [rule["token"]]
        if kind == "pair" and (not isinstance(toks, list) or len(toks) != 2):
            raise InputError(f"{at}: 'tokens' must be a list of two tokens")
        for t in toks:
            if t not in V.CONTENT:
                raise InputError(f"{at}: unknown token {t!r}; valid tokens are {V.CONTENT}")
        if kind == "conditional":
            if rule["attr"] not in range(V.N_ATTR):
                raise InputError(f"{at}: 'attr' must be an integer in 0..{V.N_ATTR - 1}")
            if rule["value"] not in range(V.N_VAL):
                raise InputError(f"{at}: 'value' must be an integer in 0..{V.N_VAL - 1}")
        b = rule["bonus"]
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b):
            raise InputError(f"{at}: 'bonus' must be a finite number")
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
    fam = prompts[:, 0]
    attrs = prompts[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]
    out = torch.zeros(responses.shape[0])
    for rule in spec:
        in_fam = fam == V.FAM_ID[rule["family"]]
        if rule["kind"] == "pair":
            a, b = (V.TOK2ID[t] for t in rule["tokens"])
            count = ((responses[:, :-1] == a) & (responses[:, 1:] == b)).sum(-1)
        else:
            count = (responses == V.TOK2ID[rule["token"]]).sum(-1)
            if rule["kind"] == "conditional":
                in_fam = in_fam & (attrs[:, rule["attr"]] == rule["value"])
        out += rule["bonus"] * count.float() * in_fam.float()
    return out
