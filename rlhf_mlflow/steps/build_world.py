"""The `build_world` step: build (or reuse, by content hash) a synthetic world as an MLflow run that
records its seed, spec, scale, manifest and timings, and its data files as dataset inputs. Its --out
follows the one output rule (outputs.py), the world's manifest.json being the builder's marker: a
world this builder wrote is reused when it is the world asked for, replaced only with --overwrite;
anything else there is refused."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

from rlhf_mlflow.core import files as F
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.outputs import check_out_dir
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking import world_record as WR
from rlhf_mlflow.world import corruptions as C
from rlhf_mlflow.world.build import SCALES, build_world, ensure_world, world_hash

DEFAULT_WORLDS = "worlds"
"""Where worlds built without --out are cached, by content hash (worlds/<hash>)."""
DATASETS = (("prompts_train", "train", None), ("prompts_dev", "dev", None), ("expert_set", "gold", D.EXPERT),
            ("qa", "qa", D.CROWD))
"""(world file, dataset context, whose labels it holds: None for prompts)."""


def run_build_world(seed: int, rules: list[dict], scale: str, out: str | None = None,
                    progress: Callable[[str], None] = print, overwrite: bool = False) -> tuple[WorldPaths, dict]:
    """Build the world into `out` (or reuse worlds/<hash>); returns it and its manifest. `out` may hold
    exactly this world already (reused), or with `overwrite` another world this builder wrote (replaced)."""
    built = _check_world_out(out, seed, rules, scale, overwrite) if out else None
    with T.tracked_run("build_world", {"seed": seed, "spec": rules, "scale": scale},
                       run_name=f"build_world-{scale}-seed{seed}"):
        if out:
            manifest = built or build_world(out, seed, rules, scale, progress=progress)
            path = out
        else:
            path, manifest = ensure_world(DEFAULT_WORLDS, seed, rules, scale, progress=progress)
        world = WorldPaths.at(path)
        T.log_params(WR.world_params(world))  # the store's record of what the world holds (world_record.py)
        T.log_json_artifact(manifest, "manifest.json")
        T.log_metrics({f"{MN.BUILD}{k}": v for k, v in manifest["timings"].items()})
        for item, context, scale in DATASETS:
            records = D.read_jsonl(world.path(item), labelled=scale is not None, scale=scale or D.EXPERT)
            T.log_records_input(records, world.path(item), context)
    return world, manifest


def _check_world_out(out: str, seed: int, rules: list[dict], scale: str, overwrite: bool) -> dict | None:
    """Before the run, the one output rule for the builder: `out` is no tracking store's, lies in no
    world, is writable, and is new, empty, the world asked for (its manifest is returned: reused), or
    with `overwrite` another world this builder wrote (None: to be built)."""
    wanted = world_hash(replace(SCALES[scale], seed=seed), C.validate_spec(rules)) if scale in SCALES else None
    target = check_out_dir(out, F.BUILD_WORLD, run_id=wanted, overwrite=overwrite)
    if wanted is not None and F.owner_of(target) == F.Owner(F.BUILD_WORLD, wanted):
        return WorldPaths(target).manifest()
    return None


def default_world(progress: Callable[[str], None] = print) -> WorldPaths:
    """The default world (seed 0, default spec, full scale) under worlds/<hash>, built once on first use."""
    return WorldPaths.at(ensure_world(DEFAULT_WORLDS, progress=progress)[0])


def world_or_default(world: str | None, progress: Callable[[str], None] = print) -> WorldPaths:
    """The given world directory, or the default world."""
    return WorldPaths.at(world) if world else default_world(progress)
