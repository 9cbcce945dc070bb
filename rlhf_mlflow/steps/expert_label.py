"""The `expert_label` step (synthetic worlds only): the world's expert annotator labels a requests
file (world/annotator.py), as an MLflow run that counts the labels it produced. A real user replaces
this step by an annotation queue that returns the same JSONL with a `label` field added."""
from __future__ import annotations

import json
from collections.abc import Callable

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.files import atomic_write_bytes
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.outputs import check_out
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.world.annotator import label_requests


def run_expert_label(world: WorldPaths, requests: str, out: str, echo: Callable[[str], None] = print,
                     run_name: str = "expert-label") -> list[dict]:
    """Label every request; write the labelled records to `out` (as the run `run_name`); returns them."""
    check_out(out, {"--requests": requests, "--world": world.root})
    records = D.read_jsonl(requests)
    missing = [i for i, r in enumerate(records, 1) if "response" not in r or "id" not in r]
    if missing:
        raise InputError(f"{requests}:{missing[0]}: a label request needs an 'id' and a 'response' to label")
    with T.tracked_run("expert_label", {"world": world.root, "requests": requests}, run_name=run_name):
        labels = label_requests(world, records)
        raw = "".join(json.dumps(r) + "\n" for r in labels).encode()
        atomic_write_bytes(out, raw)
        T.log_bytes(raw, "labels.jsonl")
        families = sorted({r["family"] for r in labels})
        T.log_metrics({f"labels/{f}": sum(r["family"] == f for r in labels) for f in families}
                      | {"labels/total": len(labels)})
    echo(f"expert labels: {len(labels)} -> {out}")
    return labels
