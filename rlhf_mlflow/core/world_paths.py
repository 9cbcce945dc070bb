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
