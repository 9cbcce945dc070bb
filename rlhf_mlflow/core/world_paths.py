"""The world directory: the seed's fixture layout, spelled out once.

A world (any fixture directory in the seed's layout, built here or not) holds:

    policy/                     the reference policy (policy.safetensors + config.json)
    reward_model/               rm.safetensors + config.json, and train.jsonl: the vendor's QA sample
    data/prompts_train.jsonl    training prompts (balanced over families)
    data/prompts_dev.jsonl      the pilot dev set (pilot traffic mix)
    data/gold_calib.jsonl       the expert set: labelled reference samples
    configs/default.json        the default RL recipe
    manifest.json               (worlds built here) seed, build hash, the digest of the files it wrote

A synthetic world also has `secret/`, which only rlhf_mlflow.world reads; it is not named here.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from rlhf_mlflow.core.digest import content_sha256, dir_files, file_sha256
from rlhf_mlflow.core.errors import InputError, read_json

LAYOUT = {"policy": "policy", "reward_model": "reward_model", "qa": "reward_model/train.jsonl",
          "prompts_train": "data/prompts_train.jsonl", "prompts_dev": "data/prompts_dev.jsonl",
          "expert_set": "data/gold_calib.jsonl", "config": "configs/default.json", "manifest": "manifest.json"}
HEX = re.compile(r"[0-9a-f]{16,64}")


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
        manifest = read_json(self.path("manifest"))
        names = [manifest.get(k) for k in ("world_hash", "world_sha256")] if isinstance(manifest, dict) else [None]
        if not isinstance(names[0], str) or not all(n is None or (isinstance(n, str) and HEX.fullmatch(n))
                                                    for n in names):
            raise InputError(f"{self.path('manifest')}: not a world builder's manifest (its 'world_hash' and "
                             "'world_sha256' must be hex digests)")
        return manifest

    def build_hash(self) -> str:
        """The manifest's `world_hash` (the build's settings); for a world built elsewhere, which has no
        manifest, the first 16 hex digits of its reward model's content hash."""
        return (self.manifest() or {}).get("world_hash") or content_sha256(self.reward_model)[:16]

    def params(self) -> dict:
        """What a run records of its world's name: its path, and when built here its seed, build hash
        (`world_hash`: the build's settings) and `world_id` (the builder's digest of the files it wrote,
        the name the store's record of the world is found by: tracking/world_record.py)."""
        m = self.manifest()
        out = {"world": self.root}
        if m:
            out.update(world_seed=m.get("seed"), world_hash=m["world_hash"],
                       world_id=m.get("world_sha256") or m["world_hash"])
        return out


def is_world(path: str) -> bool:
    """A world directory by its layout, policy/ and data/ with manifest.json, the expert set or the
    training prompts (what no --out may overwrite)."""
    def has(item: str) -> bool:
        return os.path.exists(os.path.join(path, LAYOUT[item]))
    return (os.path.isdir(os.path.join(path, LAYOUT["policy"])) and os.path.isdir(os.path.join(path, "data"))
            and (has("manifest") or has("expert_set") or has("prompts_train")))


def world_of_reference(policy_ref: str) -> WorldPaths | None:
    """The world whose reference policy (its policy/) `policy_ref` is, or None: what a recipe given
    without a world trains against (its run then records that world)."""
    parent = os.path.dirname(os.path.abspath(policy_ref))
    if os.path.abspath(policy_ref) == os.path.join(parent, LAYOUT["policy"]) and is_world(parent):
        return WorldPaths(parent)
    return None


WORLD_INPUTS = {"reference": "policy", "gold": "expert_set", "rm_dir": "reward_model", "pilot_prompts": "prompts_dev",
                "expert_set": "expert_set"}
"""The inputs of a certification that are files of the policy's world (the rest are the user's), and
the layout item each one is."""
IDENTITY = ("policy", "reward_model", "prompts_train", "prompts_dev", "expert_set", "config")
"""The layout items whose files make a world what it is (secret/ and manifest.json are not among them:
no decision reads the one, and the other only describes the build)."""


def world_files(world: WorldPaths) -> dict[str, str]:
    """{path relative to the world: sha256} of every file of the world's IDENTITY items, as they are on
    disk now: what a run records of the world it uses (tracking/world_record.py)."""
    out = {}
    for item in IDENTITY:
        path = world.path(item)
        if os.path.isdir(path):
            out.update({f"{LAYOUT[item]}/{rel}": sha for rel, sha in dir_files(path).items()})
        elif os.path.isfile(path):
            out[LAYOUT[item]] = file_sha256(path)
    return dict(sorted(out.items()))


def files_differ(recorded: dict[str, str], here: dict[str, str]) -> str | None:
    """The first difference between two {relative path: sha256} maps, in words; None when equal."""
    for rel in sorted(recorded.keys() | here.keys()):
        if rel not in here:
            return f"{rel} is missing"
        if rel not in recorded:
            return f"{rel} is not one of its files"
        if recorded[rel] != here[rel]:
            return f"{rel} differs (sha256 {here[rel][:12]}, recorded {recorded[rel][:12]})"
    return None


def input_problem(key: str, path: str, recorded: dict[str, str]) -> str | None:
    """Why certification input `key` at `path` is not, byte for byte, its item of a world whose files
    were recorded as `recorded` ({relative path: sha256}); None when it is. Compared by content: a world
    moved elsewhere is still the world, a copy with any file edited is not."""
    item = LAYOUT[WORLD_INPUTS[key]]
    wanted = {rel[len(item) + 1:] if rel != item else "": sha for rel, sha in recorded.items()
              if rel == item or rel.startswith(item + "/")}
    if not wanted:
        return f"the recorded world has no {item}"
    if os.path.isdir(path):
        here = dir_files(path)
    elif os.path.isfile(path):
        here = {"": file_sha256(path)}
    else:
        return f"{path} does not exist"
    problem = files_differ(wanted, here)
    if problem is None:
        return None
    if "" in wanted and "" in here:  # a file
        return f"{path} is not the world's {item} (sha256 {here[''][:12]}, recorded {wanted[''][:12]})"
    return f"{path} is not the world's {item}: {problem}"
