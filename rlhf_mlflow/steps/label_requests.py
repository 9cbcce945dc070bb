"""The `label_requests` step: what to ask the expert to label for a registered version (its own
responses on the expert set's prompts: decisions/label_requests.py, drawn by evidence/label_requests.py), as an MLflow run that logs the
requests file and tags the version with the run and the file's sha256, so that the labels returned
for it can be checked against exactly these requests."""
from __future__ import annotations

import json
import os
from collections.abc import Callable

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.files import atomic_write_bytes
from rlhf_mlflow.core.own_models import open_policy
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.evidence.label_requests import draw_requests
from rlhf_mlflow.steps.outputs import check_out
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T

ARTIFACT = "label_requests.jsonl"


def resolve_families(spec: str, version) -> list[str]:
    """`all`, `auto` (the families the version's certification refused off-policy) or `F,G,...`."""
    if spec == "all":
        return list(V.FAMILIES)
    if spec == "auto":
        report = REG.certification_for(version)[1]
        return [f for f, r in report["families"].items() if not r["certifiable"]]
    families = [f.strip() for f in spec.split(",") if f.strip()]
    unknown = [f for f in families if f not in V.FAMILIES]
    if unknown or not families:
        raise InputError(f"--families: unknown family {unknown[0] if unknown else spec!r}; valid are auto, all or "
                         f"a comma-separated list of {V.FAMILIES}")
    return families


def run_label_requests(version: str, world: WorldPaths, families: str = "auto", per_family: int = 10,
                       seed: int = 0, out: str = "label_requests.jsonl",
                       echo: Callable[[str], None] = print, run_name: str | None = None) -> dict:
    """Draw the requests, write them to `out`, log them (as the run `run_name`, default
    label-requests-v<version>); returns {run_id, requests, families}."""
    check_out(out, {"the expert set": world.expert_set, "--world": world.root})
    mv = REG.version_for_world(version, world)
    chosen = resolve_families(families, mv)
    expert_set = D.read_jsonl(world.expert_set, labelled=True, scale=D.EXPERT)
    params = {"model_version": str(mv.version), "families": families, "per_family": per_family, "seed": seed,
              "expert_set": world.expert_set}
    with T.tracked_run("label_requests", params, run_name=run_name or f"label-requests-v{mv.version}") as run:
        policy_dir, _ = REG.download_policy(mv.version)
        requests = draw_requests(open_policy(policy_dir), expert_set, per_family, chosen, seed,
                                 prefix=f"req-v{mv.version}")
        raw = "".join(json.dumps(r) + "\n" for r in requests).encode()
        atomic_write_bytes(out, raw)
        sha = T.log_bytes(raw, ARTIFACT)
        T.log_metrics({f"requests/{f}": sum(r["family"] == f for r in requests) for f in chosen}
                      | {"requests/total": len(requests)})
        T.log_params({REG.LABEL_REQUESTS_SHA256: sha})  # a run's parameter cannot change once logged
        REG.set_tags(mv.version, {"label_requests.run_id": run.info.run_id})
    echo(f"label requests for version {mv.version}: {len(requests)} ({', '.join(chosen) or 'no family'}) -> "
         f"{os.path.abspath(out)}")
    return {"run_id": run.info.run_id, "requests": len(requests), "families": chosen}


def run_table_requests(samples: str, families: str = "all", per_family: int = 10, seed: int = 0,
                       out: str = "label_requests.jsonl", echo: Callable[[str], None] = print) -> dict:
    """Requests drawn from a samples table (a policy trained anywhere: decisions/label_requests.py
    draw_table_requests), written to `out` and logged as a label_requests run; no model in this process."""
    from rlhf_mlflow.core.checkpoint import content_sha256
    from rlhf_mlflow.core.tables import read_samples
    from rlhf_mlflow.decisions.label_requests import draw_table_requests
    check_out(out, {"--samples": samples})
    if families == "auto":
        raise InputError("--families auto needs --model-version (the families its certification refused); with "
                         "--samples give all or F,G,...")
    chosen = resolve_families(families, None)
    rows = read_samples(samples)
    params = {"samples": os.path.abspath(samples), "samples_sha256": content_sha256(samples), "families": families,
              "per_family": per_family, "seed": seed}
    with T.tracked_run("label_requests", params, run_name="label-requests-table") as run:
        requests = draw_table_requests(rows, per_family, chosen, seed)
        raw = "".join(json.dumps(r) + "\n" for r in requests).encode()
        atomic_write_bytes(out, raw)
        T.log_params({REG.LABEL_REQUESTS_SHA256: T.log_bytes(raw, ARTIFACT)})
        T.log_metrics({f"requests/{f}": sum(r["family"] == f for r in requests) for f in chosen}
                      | {"requests/total": len(requests)})
    echo(f"label requests from {samples}: {len(requests)} ({', '.join(chosen)}) -> {os.path.abspath(out)}")
    return {"run_id": run.info.run_id, "requests": len(requests), "families": chosen}
