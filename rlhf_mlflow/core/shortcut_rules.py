"""Shortcut rules: response features paid for by something other than correctness. One schema serves
the world's corruption spec, the diagnostic's evidence, the reward correction and the
marker-collapse guardrail:

  {"family": F, "kind": "token", "token": T}                              per occurrence of T
  {"family": F, "kind": "pair", "tokens": [T1, T2]}                       per adjacent T1 T2
  {"family": F, "kind": "conditional", "token": T, "attr": i, "value": v} per T when attrs[i] == v

plus `bonus` (a number, may be negative) where one is paid.
"""
from __future__ import annotations

import math

import torch

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError, described, read_json, require

KINDS = {"token": ("token",), "pair": ("tokens",), "conditional": ("token", "attr", "value")}
FLAG_RISK = 0.5  # a diagnostic candidate at or above this risk is a flagged shortcut


def validate(rules, where: str = "rules", bonus: bool = True) -> list[dict]:
    """The rules, or InputError naming the first bad one (`where[i]`), its key and the valid values."""
    if not isinstance(rules, list):
        raise InputError(f"{where}: expected a JSON list of rules, got {type(rules).__name__}")
    for i, rule in enumerate(rules):
        _validate_rule(rule, f"{where}[{i}]", bonus)
    return rules


def _validate_rule(rule, at: str, bonus: bool) -> None:
    if not isinstance(rule, dict):
        raise InputError(f"{at}: each rule is a JSON object")
    kind = rule.get("kind")
    if kind not in KINDS:
        raise InputError(f"{at}: unknown kind {kind!r}; valid kinds are {sorted(KINDS)}")
    needed = ("family",) + (("bonus",) if bonus else ()) + KINDS[kind]
    missing = [k for k in needed if k not in rule]
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
        for key, n in (("attr", V.N_ATTR), ("value", V.N_VAL)):
            if type(rule[key]) is not int or rule[key] not in range(n):
                raise InputError(f"{at}: {key!r} must be an integer in 0..{n - 1}")
    b = rule.get("bonus", 0.0)
    if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b):
        raise InputError(f"{at}: 'bonus' must be a finite number")


def feature(candidate: dict, family: str) -> dict:
    """The rule (no bonus) of a feature described by `candidate` (a diagnostic evidence row)."""
    return {"family": family, "kind": candidate["kind"], **{k: candidate[k] for k in KINDS[candidate["kind"]]}}


def flagged(diagnostic: dict | None, where: str = "diagnostic") -> list[dict]:
    """Every flagged family's flagged features (evidence at or above FLAG_RISK, less those an expert
    set credited away as correctness: diagnostic_evidence.credit_corrections), as rules."""
    out = []
    for family, res in check_diagnostic(diagnostic or {"families": {}}, where)["families"].items():
        if res["flag"]:
            out += [feature(c, family) for c in res["evidence"]
                    if c["risk"] >= FLAG_RISK and not c.get("credited_away")]
    return out


def flagged_from(diagnostic: str | dict | None) -> list[dict]:
    """flagged() of the diagnostic evidence given as a dict or the path of its JSON file."""
    if isinstance(diagnostic, str):
        return flagged(read_json(diagnostic), diagnostic)
    return flagged(diagnostic)


def read_diagnostic(path: str) -> dict:
    """A diagnostic result file (`rlhf-mlflow diagnostic --out`), checked as check_diagnostic does."""
    return check_diagnostic(read_json(path), path)


def check_diagnostic(diagnostic, where: str) -> dict:
    """The diagnostic result {"families": {F: {"flag", "evidence": [row, ...]}}}, or InputError naming
    the first bad part: every row's numbers are numbers, every flagged row's feature a valid rule."""
    if not isinstance(diagnostic, dict) or not isinstance(diagnostic.get("families"), dict):
        raise InputError(f"{where}: expected a diagnostic result (the JSON object `rlhf-mlflow diagnostic "
                         f"--out` writes, with 'families'), got {described(diagnostic)}")
    for family, res in diagnostic["families"].items():
        at = f"{where}: families.{family}"
        if family not in V.FAMILIES:
            raise InputError(f"{at}: unknown family {family!r}; valid families are {V.FAMILIES}")
        require(res, "an object", where, f"families.{family}")
        require(res.get("flag"), "true/false", at, "flag")
        for i, row in enumerate(require(res.get("evidence"), "a list", at, "evidence")):
            _check_evidence_row(row, family, f"{at}.evidence[{i}]")
    return diagnostic


def _check_evidence_row(row, family: str, at: str) -> None:
    require(row, "an object", at, "row")
    for key in ("risk", "correction", "correction_se"):
        if key == "risk" or key in row:
            require(row.get(key), "a finite number", at, key)
    if "correction" in row and "correction_se" not in row:
        raise InputError(f"{at}: a row with 'correction' needs 'correction_se'")
    if row["risk"] >= FLAG_RISK:  # a flagged feature becomes a rule: it must be one
        if row.get("kind") not in KINDS:
            raise InputError(f"{at}: unknown kind {row.get('kind')!r}; valid kinds are {sorted(KINDS)}")
        _validate_rule({"family": family, "kind": row["kind"], **{k: row[k] for k in KINDS[row["kind"]] if k in row}},
                       at, bonus=False)


def count(rule: dict, record: dict, tokens: list[str]) -> int:
    """How often the rule's feature occurs in one response (tokens) to one prompt record."""
    if record["family"] != rule["family"]:
        return 0
    if rule["kind"] == "pair":
        a, b = rule["tokens"]
        return sum(1 for x, y in zip(tokens, tokens[1:]) if x == a and y == b)
    if rule["kind"] == "conditional" and record["attrs"][rule["attr"]] != rule["value"]:
        return 0
    return tokens.count(rule["token"])


def counts(rule: dict, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """count() for token ids: prompts (N, P), responses (N, L) -> (N,) occurrences."""
    in_family = prompts[:, 0] == V.FAM_ID[rule["family"]]
    if rule["kind"] == "pair":
        a, b = (V.TOK2ID[t] for t in rule["tokens"])
        n = ((responses[:, :-1] == a) & (responses[:, 1:] == b)).sum(-1)
    else:
        n = (responses == V.TOK2ID[rule["token"]]).sum(-1)
        if rule["kind"] == "conditional":
            attrs = prompts[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]
            in_family = in_family & (attrs[:, rule["attr"]] == rule["value"])
    return n * in_family


def describe(rule: dict) -> str:
    """`pa`, `ba+da` (a pair) or `he|a2=3` (a conditional token)."""
    if rule["kind"] == "pair":
        return "+".join(rule["tokens"])
    if rule["kind"] == "conditional":
        return f"{rule['token']}|a{rule['attr']}={rule['value']}"
    return rule["token"]


def largest_rise(counted: list[dict]) -> dict | None:
    """The shortcut among one family's counts (certify.family_evidence's `shortcuts`) whose count per
    answer rose most over the reference's, with the rise and its se; None without shortcuts."""
    if not counted:
        return None
    top = max(counted, key=lambda s: s["policy_count"] - s["reference_count"])
    return {"rule": describe(top), "policy_count": top["policy_count"], "reference_count": top["reference_count"],
            "rise": top["policy_count"] - top["reference_count"], "se": top["policy_count_se"]}
