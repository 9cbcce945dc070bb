"""Records (JSON Lines) and their tensors: prompts, labelled responses, family grouping and batching.

Prompt record: {"id", "family", "attrs": [a1..a4]}; a labelled row adds "response": [8 tokens] and
"label": float on the annotation scale (LABEL_RANGES). Every reader validates, and bad input (bad bytes,
bad JSON, a field of the wrong type, a label far off the scale) names the file and line.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable

import torch

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError, described, parse_json, read_text, require
from rlhf_mlflow.core.files import atomic_open

EXPERT, CROWD = "expert", "crowd"
LABEL_RANGES = {EXPERT: (-1.0, 2.0), CROWD: (-20.0, 20.0)}
"""The plausible range of a label, by who gave it: a label outside it is not on the annotation scale
(a percentage, a rating out of 5 or 10, an overflow) and is refused naming file, line, id and the range.

The scale is the fraction of a response's 8 positions an annotator judges correct (1.0: perfect), plus
the annotator's noise, which the seed does not clip: its expert set's per-family ranges run from -0.145
to 0.863 (anvil [-0.056, 0.672]), so expert labels a little below 0 or above 1 are ordinary. An expert
label is truth in [0, 1] plus noise of a few hundredths (sd ~0.03-0.05): [-1, 2] is a whole unit of
noise beyond either end, far outside anything an expert on this scale gives. Crowd labels add the
vendor's shortcut bonuses on top: the seed's QA sample reaches 4.81 (dune, `pa` +1.39 per occurrence)
and runs down to -0.27; the default spec's dune bonus (+1.45) on all 8 positions would pay up to
1 + 8 x 1.45 = 12.6. [-20, 20]
holds every label such a vendor gives (a world spec's bonuses are bounded so that its crowd labels stay
inside: world/corruptions.py) and still refuses a percentage scale or a runaway number."""


def check_record(rec, where: str, labelled: bool | None, scale: str = CROWD) -> dict:
    if not isinstance(rec, dict):
        raise InputError(f"{where}: expected a JSON object, got {described(rec)}")
    if "id" in rec:  # ids are strings (`gold-00012`, `req-dune-003`); the seed's integer ids pass too
        require(rec["id"], "a string or an integer", where, "id")
    fam = rec.get("family")
    if fam is not None and not isinstance(fam, str):
        require(fam, "a string", where, "family")
    if fam not in V.FAMILIES:
        raise InputError(f"{where}: unknown family {fam!r}; valid families are {V.FAMILIES}")
    attrs = rec.get("attrs")
    if (not isinstance(attrs, list) or len(attrs) != V.N_ATTR
            or not all(isinstance(a, int) and not isinstance(a, bool) and 0 <= a < V.N_VAL for a in attrs)):
        raise InputError(f"{where}: 'attrs' must be {V.N_ATTR} integers in 0..{V.N_VAL - 1}, "
                         f"got {described(attrs)}")
    has_resp = "response" in rec
    if labelled and not has_resp:
        raise InputError(f"{where}: labelled record has no 'response'")
    if has_resp:
        resp = rec["response"]
        if not isinstance(resp, list) or len(resp) != V.RESP_LEN:
            raise InputError(f"{where}: 'response' must be a list of {V.RESP_LEN} tokens, "
                             f"got {described(resp)}")
        bad = [t if isinstance(t, str) else described(t) for t in resp if t not in V.CONTENT]
        if bad:
            raise InputError(f"{where}: unknown response token {bad[0]!r}; valid tokens are {V.CONTENT}")
    if labelled:
        check_label(rec.get("label"), f"{where} (id {rec.get('id')!r})", scale)
    return rec


def check_label(label, where: str, scale: str) -> float:
    """The label, or InputError naming `where` unless it is a finite number inside LABEL_RANGES[scale]."""
    lo, hi = LABEL_RANGES[scale]
    if not isinstance(label, (int, float)) or isinstance(label, bool) or not math.isfinite(label):
        raise InputError(f"{where}: 'label' must be a finite number, got {described(label)}")
    if not lo <= label <= hi:
        raise InputError(f"{where}: 'label' {label!r} is outside the plausible range of {scale} labels "
                         f"[{lo:g}, {hi:g}] (the fraction of 8 positions correct, plus the annotator's noise"
                         f"{'' if scale == EXPERT else ' and bonuses'}): not on the annotation scale")
    return label


def read_jsonl(path: str, labelled: bool | None = None, scale: str = CROWD) -> list[dict]:
    """Read and validate records; labelled=True requires response and label on every row, each label
    inside LABEL_RANGES[scale]: `expert` for an expert set or expert labels, `crowd` (the wider range,
    the default) for a crowd batch, its QA sample or any other labelled file."""
    out = []
    for lineno, line in enumerate(read_text(path).split("\n"), 1):
        if line.strip():
            where = f"{path}:{lineno}"
            out.append(check_record(parse_json(line, path, lineno), where, labelled, scale))
    if not out:
        raise InputError(f"{path}: no records")
    return out


def write_jsonl(path: str, records: Iterable[dict]) -> None:
    """Write records one per line; the file appears whole or not at all."""
    with atomic_open(path) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def prompts_tensor(records: list[dict]) -> torch.Tensor:
    """(N, PROMPT_LEN) token ids."""
    fam = torch.tensor([V.FAM_ID[r["family"]] for r in records], dtype=torch.long)
    attrs = torch.tensor([r["attrs"] for r in records], dtype=torch.long).view(-1, V.N_ATTR)
    vals = attrs + V.VAL_ID[0]  # value ids are contiguous
    sep = torch.full((len(records), 1), V.SEP, dtype=torch.long)
    return torch.cat([fam[:, None], vals, sep], 1)


def responses_tensor(records: list[dict]) -> torch.Tensor:
    """(N, RESP_LEN) token ids."""
    return torch.tensor([[V.TOK2ID[t] for t in r["response"]] for r in records], dtype=torch.long).view(
        -1, V.RESP_LEN)


def labels_tensor(records: list[dict]) -> torch.Tensor:
    return torch.tensor([float(r["label"]) for r in records], dtype=torch.float32)


def family_index(records: list[dict]) -> torch.Tensor:
    """(N,) index of each record's family in vocab.FAMILIES."""
    pos = {f: i for i, f in enumerate(V.FAMILIES)}
    return torch.tensor([pos[r["family"]] for r in records], dtype=torch.long)


def group_by_family(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["family"], []).append(r)
    return out


def check_family_weights(weights: dict | None, where: str = "family_weights") -> dict[str, float] | None:
    if weights is None:
        return None
    if not isinstance(weights, dict) or not weights:
        raise InputError(f"{where}: expected a mapping family -> weight, got {weights!r}")
    for f, w in weights.items():
        if f not in V.FAMILIES:
            raise InputError(f"{where}: unknown family {f!r}; valid families are {V.FAMILIES}")
        if not isinstance(w, (int, float)) or w < 0 or not math.isfinite(w):
            raise InputError(f"{where}: weight of {f!r} must be a finite number >= 0, got {w!r}")
    if sum(weights.values()) <= 0:
        raise InputError(f"{where}: at least one weight must be > 0")
    return {f: float(w) for f, w in weights.items()}


class PromptSampler:
    """Draws batches of prompt records: family by weight, then a prompt uniformly within the family."""

    def __init__(self, records: list[dict], family_weights: dict[str, float] | None = None):
        by_fam = group_by_family(records)
        weights = family_weights or {f: 1.0 for f in by_fam}
        missing = [f for f, w in weights.items() if w > 0 and f not in by_fam]
        if missing:
            raise InputError(f"family_weights: families {missing} have no prompts in the prompt file; "
                             f"families present are {sorted(by_fam)}")
        self.families = [f for f in V.FAMILIES if weights.get(f, 0) > 0]
        self.by_fam = [by_fam[f] for f in self.families]
        self.probs = torch.tensor([weights[f] for f in self.families], dtype=torch.float64)
        self.probs /= self.probs.sum()
        self.tensors = [prompts_tensor(rs) for rs in self.by_fam]

    def sample(self, batch: int, generator: torch.Generator) -> tuple[list[dict], torch.Tensor]:
        fams = torch.multinomial(self.probs, batch, replacement=True, generator=generator).tolist()
        u = torch.rand(batch, generator=generator, dtype=torch.float64).tolist()
        picks = [(f, int(x * len(self.by_fam[f]))) for f, x in zip(fams, u)]
        records = [self.by_fam[f][i] for f, i in picks]
        prompts = torch.stack([self.tensors[f][i] for f, i in picks])
        return records, prompts


def sample_prompt_batch(by_fam: dict[str, list[dict]], weights: dict[str, float], batch: int,
                        rng: torch.Generator) -> list[dict]:
    """Seed-compatible helper: a list of `batch` prompt records drawn with the family weights."""
    records = [r for f in V.FAMILIES for r in by_fam.get(f, [])]
    return PromptSampler(records, weights).sample(batch, rng)[0]
