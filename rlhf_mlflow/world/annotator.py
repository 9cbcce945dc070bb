"""The expert annotator of a synthetic world: it plays the human expert who labels a policy's own
responses. A label is the response's true quality q plus the expert set's own noise (the world's
`gold_noise`), unclipped as the seed's expert labels are (its expert set runs from -0.145 to 0.863): a
response with no correct position can get a label a little below 0, a perfect one a little above 1, and
the noise's mean stays 0 (clipping at 0 and 1 biased the mean label up by 0.003-0.004 on a world whose
quality sits near 0). Every reader of labels takes them (core/records.py LABEL_RANGES). The noise of a
request is seeded by its id, so asking twice gives the same label. With the oracle, the only reader of
`secret/`; a real user replaces it by an annotation queue returning the same JSONL with a `label` field
added."""
from __future__ import annotations

import hashlib

import numpy as np

from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.world.oracle import Oracle

DEFAULT_NOISE = 0.03  # the builder's gold_noise, for a world whose manifest does not say


def expert_noise(world: WorldPaths) -> float:
    manifest = world.manifest() or {}
    return float(manifest.get("config", {}).get("gold_noise", DEFAULT_NOISE))


def label_requests(world: WorldPaths, requests: list[dict]) -> list[dict]:
    """The requests with `label` added: truth + the expert's noise (mean 0, unclipped, as the seed's)."""
    truth = Oracle(world.root).score_records(requests)
    sd = expert_noise(world)
    out = []
    for rec, q in zip(requests, truth):
        seed = int.from_bytes(hashlib.sha256(f"expert:{rec['id']}".encode()).digest()[:8], "little")
        noise = sd * np.random.default_rng(seed).standard_normal()
        out.append({**rec, "label": round(float(q + noise), 4)})
    return out
