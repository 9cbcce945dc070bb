"""The world directory: the seed's fixture layout, spelled out once.

A world (any fixture directory in the seed's layout, built here or not) holds:

    policy/                     the reference policy (policy.safetensors + config.json)
    reward_model/               rm.safetensors + config.json, and train.jsonl: the vendor's QA sample
    data/prompts_train.jsonl    training prompts (balanced over families)
    data/prompts_dev.jsonl      the pilot dev set (pilot traffic mix)
    data/gold_calib.jsonl       the expert set: labelled reference samples
    configs/default.json        the default RL recipe
    manifest.json               (worlds built here) seed, content hash, file hashes

A synthetic world also has `secret/`, which only rlhf_mlflow.world reads; it is not named here.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from rlhf_mlflow.core.errors import InputError

LAYOUT = {"policy": "policy", "reward_model": "reward_model", "qa": "reward_model/train.jsonl",
          "prompts_train": "data/prompts_train.jsonl", "prompts_dev": "data/prompts_dev.jsonl",
          "expert_set": "data/gold_calib.jsonl", "config": "configs/default.json", "manifest": "manifest.json"}


@dataclass(frozen=True)
class WorldPaths:
    root: str
    """The world directory (absolute)."""

    @classmethod
    def at(cls, root: str) -> "WorldPaths":
        """The world at `root`, which must be a directory."""
        if not os.path.isdir(root):
            raise InputError(f"{root}: no such world directory")
        return cls(os.path.abspath(root))

    def path(self, item: str) -> str:
        return os.path.join(self.root, LAYOUT[item])

    policy = property(lambda self: self.path("policy"))
    reward_model = property(lambda self: self.path("reward_model"))
    qa = property(lambda self: self.path("qa"))
    prompts_train = property(lambda self: self.path("prompts_train"))
    prompts_dev = property(lambda self: self.path("prompts_dev"))
    expert_set = property(lambda self: self.path("expert_set"))
    config = property(lambda self: self.path("config"))

    def require(self, *items: str) -> "WorldPaths":
        """Self, or InputError naming every missing item of the layout."""
        missing = [LAYOUT[i] for i in items if not os.path.exists(self.path(i))]
        if missing:
            raise InputError(f"world {self.root} lacks {', '.join(missing)} (the seed's fixture layout has "
                             f"{', '.join(LAYOUT[i] for i in LAYOUT if i != 'manifest')})")
        return self

    def manifest(self) -> dict | None:
        """The builder's manifest, or None for a fixture built elsewhere."""
        if not os.path.isfile(self.path("manifest")):
            return None
        with open(self.path("manifest")) as f:
            return json.load(f)

    def params(self) -> dict:
        """What a run records of its world: its path, and its seed and content hash when built here."""
        m = self.manifest()
        out = {"world": self.root}
        if m:
            out.update(world_seed=m["seed"], world_hash=m["world_hash"])
        return out


def is_world(path: str) -> bool:
    """A world directory by its layout, policy/ and data/ with manifest.json, the expert set or the
    training prompts (what no --out may overwrite; `enclosing_world` below asks more of one: a
    builder's manifest listing its files)."""
    def has(item: str) -> bool:
        return os.path.exists(os.path.join(path, LAYOUT[item]))
    return (os.path.isdir(os.path.join(path, LAYOUT["policy"])) and os.path.isdir(os.path.join(path, "data"))
            and (has("manifest") or has("expert_set") or has("prompts_train")))


WORLD_INPUTS = ("reference", "gold", "rm_dir", "pilot_prompts")
"""The inputs of a certification that are files of the policy's world (the rest are the user's)."""


def enclosing_world(path: str) -> WorldPaths | None:
    """The built world (a directory whose manifest.json lists its files) that holds `path`, or None."""
    here = os.path.dirname(os.path.realpath(path))
    while True:
        if os.path.isfile(os.path.join(here, LAYOUT["manifest"])):
            world = WorldPaths(here)
            try:
                if isinstance((world.manifest() or {}).get("files"), dict):
                    return world
            except (OSError, ValueError):
                pass
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def world_file_problem(path: str, world_hash: str) -> str | None:
    """Why `path` is not, byte for byte, a file (or directory) of world `world_hash` as its builder wrote
    it, in words; None when it is. A world is its manifest: a copy whose files were edited is not it."""
    import hashlib
    world = enclosing_world(path)
    if world is None:
        return f"{path} is not in a world built here (no manifest.json above it); world {world_hash} has its own"
    manifest = world.manifest()
    if manifest.get("world_hash") != world_hash:
        return f"{path} is a file of world {manifest.get('world_hash')}, not of world {world_hash}"
    rel = os.path.relpath(os.path.realpath(path), world.root)
    listed = {k: v for k, v in manifest["files"].items() if k == rel or k.startswith(rel + os.sep)}
    if not listed:
        return f"{path}: world {world_hash}'s manifest lists no such file"
    for name, sha in sorted(listed.items()):
        try:
            with open(os.path.join(world.root, name), "rb") as f:
                same = hashlib.sha256(f.read()).hexdigest() == sha
        except OSError:
            same = False
        if not same:
            return (f"{os.path.join(world.root, name)} is not the file world {world_hash} was built with "
                    "(missing or changed since; its manifest.json holds each file's sha256)")
    return None
