"""What to ask an expert to label: a policy's own responses on prompts it was not trained on, and the
checks a returned labels file must pass before it counts as evidence.

The prompts are the expert set's (data/gold_calib.jsonl): drawn from each family's prompt
distribution, never in the RL prompt pool, and already the prompts certify's unlabelled policy
samples are drawn on, so labelled and unlabelled samples share one estimand (the policy's quality on
the family's traffic). Per family the prompts come in a seeded order and each gets one response of
the policy at the deployment temperature, drawn from its own seeded stream: the first K requests of a
family are the same whatever K, so labels bought in rounds extend each other (evidence/label_requests.py
draws a live policy's; `draw_table_requests` picks rows of a table of samples).
"""
from __future__ import annotations

import hashlib

import torch

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError

FIELDS = ("id", "family", "attrs", "response")


def request_stream(seed: int, family: str) -> torch.Generator:
    """A family's own seeded random stream of label requests (its prompts' order, its responses)."""
    digest = hashlib.sha256(f"{seed}:{family}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))


def draw_table_requests(samples: list[dict], per_family: int, families: list[str] | None = None,
                        seed: int = 0) -> list[dict]:
    """Up to `per_family` rows of a samples table per family to ask the expert about (core/tables.py's
    checked rows), one per distinct prompt, the prompts in a seeded order per family (the first K are the
    same whatever K: labels bought in rounds extend each other); each request is the row as given
    (the seed's fields as seed records), so the labels returned name the samples' ids."""
    out = []
    for family in [f for f in V.FAMILIES if families is None or f in families]:
        rows = [r for r in samples if r["family"] == family]
        first = {}
        for r in rows:
            first.setdefault(r["prompt_key"], r)
        order = torch.randperm(len(first), generator=request_stream(seed, family)).tolist()
        prompts = list(first)
        for i in order[:per_family]:
            r = first[prompts[i]]
            plain = {k: v for k, v in r.items() if k not in ("prompt_key", "seed", "_at")}
            out.append({**plain, **(r["seed"] or {})})
    return out


def check_labels(labels: list[dict], requests: list[dict] | None, where: str) -> list[dict]:
    """The labelled records, or InputError naming the first problem: a duplicated id, a label that is
    not a finite number inside the expert labels' plausible range (records.LABEL_RANGES: the fraction of
    8 positions correct plus the expert's unclipped noise, so a little below 0 or above 1 is ordinary),
    and with `requests`, an id not among them or a record that differs from its request (another
    version's responses, an edited file)."""
    seen = set()
    wanted = {r["id"]: r for r in requests} if requests is not None else None
    for i, rec in enumerate(labels, 1):
        at = f"{where}: record {i} (id {rec.get('id')!r})"
        if rec.get("id") in seen:
            raise InputError(f"{at}: duplicated id")
        seen.add(rec.get("id"))
        D.check_label(rec.get("label"), at, D.EXPERT)
        if wanted is None:
            continue
        if rec.get("id") not in wanted:
            raise InputError(f"{at}: not among the label requests (labels for another version or request set?)")
        diff = [k for k in FIELDS if rec.get(k) != wanted[rec["id"]].get(k)]
        if diff:
            raise InputError(f"{at}: {', '.join(diff)} differ from the request (not the response this version "
                             "was asked about)")
    return labels


def read_labels(path: str) -> list[dict]:
    """A labels file (records with `label`), checked as check_labels does without the requests."""
    return check_labels(D.read_jsonl(path, labelled=True, scale=D.EXPERT), None, path)


def read_label_files(paths: list[str]) -> list[dict]:
    """Every labels file read as read_labels does, with no id in two files (the same label counted twice)."""
    out, where = [], {}
    for path in paths:
        for i, rec in enumerate(read_labels(path), 1):
            if rec["id"] in where:
                raise InputError(f"{path}: record {i} (id {rec['id']!r}): duplicated id, already in {where[rec['id']]}")
            where[rec["id"]] = f"{path} record {i}"
            out.append(rec)
    return out


def check_prompts_known(labels: list[dict], prompt_files: dict[str, list[dict]], world: str) -> None:
    """InputError unless every label's prompt (family and attributes) is one of the world's prompts
    (`prompt_files`: path -> records): labels for another world are caught here."""
    known = {(r["family"], tuple(r["attrs"])) for rows in prompt_files.values() for r in rows}
    for i, rec in enumerate(labels, 1):
        if (rec["family"], tuple(rec["attrs"])) not in known:
            raise InputError(f"label {i} (id {rec['id']!r}, {rec['family']} {rec['attrs']}): its prompt is in none of "
                             f"world {world}'s prompt files ({', '.join(prompt_files)}): labels for another world?")


def labels_used(file: str, sha256: str, labels: list[dict], bought_on: dict) -> dict:
    """What a report says of the expert labels it used (`labels`: records with `id` and `family`): the
    file and its sha256, which policy's answers they were bought on, and every label's id per family."""
    return {"file": file, "sha256": sha256, "labels": len(labels), "bought_on": bought_on,
            "ids": {f: [str(r["id"]) for r in rows] for f, rows in D.group_by_family(labels).items()}}
