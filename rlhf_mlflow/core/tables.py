"""Tables a user writes from any stack: a policy's samples, expert labels on some of them, an expert set.

JSON Lines, CSV or Parquet (by extension), read by pandas and checked row by row; every problem is one
InputError naming the file, the row (a JSONL file's line; a CSV file's line, its header being line 1;
a Parquet file's row, from 1) and the column. Other columns are kept.

- samples: one row per sampled response of the candidate policy: `id` (unique), `family`, `prompt`
  (string), `response` (string), `score` (the reward model's score of it, finite); optional
  `logp_policy`, `logp_reference` (its sequence log-probabilities under the policy and the reference:
  the KL guardrail reads them). Rows from the seed's worlds may carry the seed's record fields instead
  of `prompt`: `attrs` (four prompt attributes) and `response` as the seed's eight tokens (a list, or
  one string of space-separated tokens); such rows also work with the world-aware predictor (the label
  head) and with shortcut counts. Optional `prompt_id`: rows sharing it are samples of one draw of a
  prompt (default: rows with the same prompt are), e.g. the expert set's row id where a prompt was drawn
  twice.
- labels: `id`, `label` for the rows an expert labelled (ids of the samples), on the expert annotation
  scale (core/records.py LABEL_RANGES: a fraction of correct positions plus the expert's noise).
- expert set: labelled samples of the reference policy (the world's `data/gold_calib.jsonl`, or any
  table with `id`, `family`, `prompt` or `attrs`, `response`, `label`), optionally with `score` (then
  the reward model is calibrated on it) and `logp_policy`, `logp_reference` (then it is off-policy
  evidence about the candidate).
"""
from __future__ import annotations

import json
import math
import os

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet",
           ".pq": "parquet"}
SAMPLES = ("id", "family", "response", "score")
"""Columns every samples table has, with `prompt` or the seed's `attrs`."""
LOGPS = ("logp_policy", "logp_reference")
MAX_ROWS = 2_000_000


def read_table(path: str, what: str) -> tuple[list[dict], callable]:
    """The rows of a table file as dicts (missing cells dropped), and a function naming row i (0-based)
    as the file counts it."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise InputError(f"{path}: a {what} table must be JSON Lines (.jsonl), CSV (.csv) or Parquet (.parquet), "
                         f"got {ext or 'no extension'}")
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    kind = FORMATS[ext]
    if kind == "jsonl":
        return _jsonl_rows(path), lambda i: f"{path}:{i + 1}"
    import pandas as pd
    try:
        frame = pd.read_csv(path, keep_default_na=True) if kind == "csv" else pd.read_parquet(path)
    except Exception as e:  # pandas and pyarrow raise many kinds; each is the file's fault here
        raise InputError(f"{path}: not a readable {kind.upper()} table ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if len(frame) > MAX_ROWS:
        raise InputError(f"{path}: {len(frame)} rows, more than the {MAX_ROWS} a table may hold")
    rows = [{k: _plain(v) for k, v in rec.items() if not _missing(v)} for rec in frame.to_dict("records")]
    return rows, (lambda i: f"{path}:{i + 2}") if kind == "csv" else (lambda i: f"{path}: row {i + 1}")


def _jsonl_rows(path: str) -> list[dict]:
    from rlhf_mlflow.core.errors import parse_json, read_text
    rows = []
    for lineno, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        rec = parse_json(line, path, lineno)
        if not isinstance(rec, dict):
            raise InputError(f"{path}:{lineno}: a row must be a JSON object, got {type(rec).__name__}")
        if len(rows) >= MAX_ROWS:
            raise InputError(f"{path}: more than the {MAX_ROWS} rows a table may hold")
        rows.append(rec)
    return rows


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _plain(v):
    """numpy scalars and arrays (what pandas hands back) as plain Python values."""
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


def _need(rows: list[dict], where, path: str, columns, what: str) -> None:
    for i, r in enumerate(rows):
        lacking = [c for c in columns if c not in r]
        if lacking:
            raise InputError(f"{where(i)}: column {lacking[0]!r} is missing (a {what} table has "
                             f"{', '.join(columns)})")


def _number(r: dict, col: str, at: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    v = r[col]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise InputError(f"{at}: column {col!r} must be a number, got {v!r}") from None
    if not math.isfinite(v) or not lo <= v <= hi:
        raise InputError(f"{at}: column {col!r} must be a finite number"
                         + (f" in [{lo:g}, {hi:g}]" if math.isfinite(lo) or math.isfinite(hi) else "")
                         + f", got {v!r}")
    return float(v)


def _family(r: dict, at: str) -> str:
    if r["family"] not in V.FAMILIES:
        raise InputError(f"{at}: column 'family': unknown family {r['family']!r} (valid: {', '.join(V.FAMILIES)})")
    return r["family"]


def _seed_fields(r: dict, at: str) -> dict | None:
    """The row's seed record (id, family, attrs, response tokens) when it carries `attrs`, else None."""
    if "attrs" not in r:
        return None
    attrs = r["attrs"]
    if isinstance(attrs, str):  # a CSV cell: "[1, 2, 3, 4]"
        try:
            attrs = json.loads(attrs)
        except ValueError:
            raise InputError(f"{at}: column 'attrs' must be a list of {V.N_ATTR} integers, got {attrs!r}") from None
    tokens = r["response"].split() if isinstance(r["response"], str) else r["response"]
    return D.check_record({"id": str(r["id"]), "family": r["family"], "attrs": attrs, "response": tokens}, at, None)


def _prompt_key(r: dict, seed: dict | None, at: str) -> str:
    if seed is not None:
        return " ".join(str(a) for a in seed["attrs"])
    if not isinstance(r.get("prompt"), str):
        raise InputError(f"{at}: column 'prompt' is missing or not a string (or give the seed's 'attrs')")
    return r["prompt"]


def _rows(path: str, what: str, required: tuple[str, ...], numbers: tuple[str, ...]) -> list[dict]:
    """Checked rows: `family`, `prompt_key` (the prompt, or the seed's attrs), `seed` (the seed record
    or None), the `numbers` as floats (those present beyond the required), the rest kept."""
    rows, where = read_table(path, what)
    if not rows:
        raise InputError(f"{path}: the {what} table has no rows")
    _need(rows, where, path, required, what)
    out, seen = [], {}
    for i, r in enumerate(rows):
        at = where(i)
        r = {**r, "id": str(r["id"])}
        if r["id"] in seen:
            raise InputError(f"{at}: column 'id': {r['id']!r} duplicates row {seen[r['id']]}")
        seen[r["id"]] = i + 1
        _family(r, at)
        if not isinstance(r["response"], (str, list)):
            raise InputError(f"{at}: column 'response' must be a string, got {type(r['response']).__name__}")
        seed = _seed_fields(r, at)
        prompt = _prompt_key(r, seed, at)
        r.update({c: _number(r, c, at) for c in numbers if c in r}, prompt_text=prompt, seed=seed, _at=at,
                 prompt_key=f"#{r['prompt_id']}" if "prompt_id" in r else prompt)
        if sum(c in r for c in LOGPS) == 1:
            raise InputError(f"{at}: columns {' and '.join(LOGPS)} come together (a KL needs both)")
        out.append(r)
    return out


def read_samples(path: str) -> list[dict]:
    """A samples table, checked (see the module docstring)."""
    return _rows(path, "samples", SAMPLES, ("score", *LOGPS))


def read_expert_set(path: str) -> list[dict]:
    """An expert-set table, checked: labelled reference samples, optional scores and log-probs."""
    rows = _rows(path, "expert set", ("id", "family", "response", "label"), ("score", *LOGPS))
    for r in rows:
        r["label"] = _label(r)
    return rows


def read_labels(path: str, samples: list[dict], samples_path: str) -> dict[str, float]:
    """{sample id: label} from a labels table (`id`, `label`): every id one of the samples', none twice."""
    rows, where = read_table(path, "labels")
    _need(rows, where, path, ("id", "label"), "labels")
    ids, out = {r["id"] for r in samples}, {}
    for i, r in enumerate(rows):
        at, rid = where(i), str(r["id"])
        if rid not in ids:
            raise InputError(f"{at}: column 'id': {rid!r} is not a row of the samples table {samples_path}")
        if rid in out:
            raise InputError(f"{at}: column 'id': {rid!r} is labelled twice")
        out[rid] = _label({**r, "_at": at})
    return out


def _label(r: dict) -> float:
    """An expert label on the annotation scale (records.LABEL_RANGES: the seed's expert noise goes below 0)."""
    lo, hi = D.LABEL_RANGES[D.EXPERT]
    return _number(r, "label", r["_at"], lo, hi)
