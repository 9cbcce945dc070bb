"""Safetensors checkpoints with a config.json beside them (the seed's layout). Never unpickles.

A checkpoint appears whole or not at all: a directory of its own is written beside its target and
renamed into place. In a directory that holds other files too (train-rl's --out, the final policy
beside step_N/ and log.jsonl), config.json goes first and comes back last, after the weights:
loaders read config.json first, so a half-written checkpoint is no checkpoint.

A copy of a checkpoint (an upload to an artifact store, which is neither atomic nor ordered) is
judged by its MANIFEST.json: every file's relative path, size and sha256, written after the files
and copied after them (`write_manifest`); `verify_manifest` says what a copy lacks.
"""
from __future__ import annotations

import json
import os

import torch.nn as nn
from safetensors.torch import load_file, save, save_file

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.digest import content_sha256, file_sha256, files_under  # noqa: F401 (checkpoint's API)
from rlhf_mlflow.core.errors import InputError, read_json
from rlhf_mlflow.core.files import atomic_dir, atomic_write_bytes, atomic_write_json

CONFIG = "config.json"


def save_module(module: nn.Module, cfg: dict, out_dir: str, weights_name: str) -> None:
    tensors = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    if os.path.isdir(out_dir) and set(os.listdir(out_dir)) - {weights_name, CONFIG}:
        config = os.path.join(out_dir, CONFIG)
        if os.path.exists(config):
            os.remove(config)
        atomic_write_bytes(os.path.join(out_dir, weights_name), save(tensors))
        atomic_write_json(config, cfg)
        return
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, os.path.join(tmp, weights_name))
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(cfg, f, indent=1)


# what every config.json value must be, beside being a positive integer
FIXED = {"vocab_size": (len(V.TOKENS), "the vocabulary's size (vocab.py)"),
         "seq_len": (V.SEQ_LEN, "prompt_len + resp_len"),
         "prompt_len": (V.PROMPT_LEN, "family, 4 attribute values and <sep>"),
         "resp_len": (V.RESP_LEN, "tokens per response")}
# the largest sizes a config.json may ask for (the world's models are 64-96 wide and 2 deep): generous,
# and checked before anything is allocated, so that a typo is a sentence instead of a failed allocation
LIMITS = {"d_model": 4096, "n_layers": 64, "n_heads": 64, "d_ff": 16384}
MAX_PARAMETERS = 10 ** 9  # 4 GiB of float32 weights, before Adam's two copies


def read_config(ckpt_dir: str, required: tuple[str, ...]) -> dict:
    """config.json with every required key, each a positive integer consistent with vocab.py."""
    path = os.path.join(ckpt_dir, CONFIG)
    cfg = read_json(path, "no config.json (expected a checkpoint directory)")
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: expected a JSON object of config keys, got {type(cfg).__name__}")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise InputError(f"{path}: missing config keys {missing}; required keys are {list(required)}")
    for k in required:
        check_config_value(path, k, cfg[k])
    if "d_model" in required and "n_heads" in required and cfg["d_model"] % cfg["n_heads"]:
        raise InputError(f"{path}: 'd_model' ({cfg['d_model']}) must be divisible by 'n_heads' ({cfg['n_heads']})")
    if {"d_model", "n_layers", "d_ff", "vocab_size", "seq_len"} <= set(required):
        d, n_layers, d_ff = cfg["d_model"], cfg["n_layers"], cfg["d_ff"]
        n = n_layers * (4 * d * d + 2 * d * d_ff) + (2 * cfg["vocab_size"] + cfg["seq_len"]) * d
        if n > MAX_PARAMETERS:
            raise InputError(f"{path}: d_model {d}, n_layers {n_layers} and d_ff {d_ff} make about {n / 1e9:.1f}B "
                             f"parameters; at most {MAX_PARAMETERS / 1e9:.0f}B are allowed")
    return cfg


def check_config_value(path: str, key: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{path}: {key!r} must be a positive integer, got {value!r}")
    if key in FIXED and value != FIXED[key][0]:
        want, why = FIXED[key]
        raise InputError(f"{path}: {key!r} must be {want} ({why}), got {value!r}")
    if key in LIMITS and value > LIMITS[key]:
        raise InputError(f"{path}: {key!r} must be an integer in [1, {LIMITS[key]}], got {value}")


def load_weights(module: nn.Module, ckpt_dir: str, weights_name: str) -> None:
    path = os.path.join(ckpt_dir, weights_name)
    if not os.path.isfile(path):
        raise InputError(f"{path}: missing weights file")
    try:
        state = load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise InputError(f"{path}: not a readable safetensors file ({e})") from None
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = "; ".join(line.strip() for line in first[1:4]) or first[0]
        raise InputError(f"{path}: weights do not match {ckpt_dir}/config.json: {detail}") from None
    module.eval()


def freeze(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


MANIFEST = "MANIFEST.json"


def write_manifest(ckpt_dir: str) -> None:
    """MANIFEST.json in `ckpt_dir`: the relative path, size and sha256 of every other file under it.
    Written once the checkpoint's files are final; a copy is whole when its files match it."""
    files = {rel: {"size": os.path.getsize(os.path.join(ckpt_dir, rel)),
                   "sha256": file_sha256(os.path.join(ckpt_dir, rel))}
             for rel in files_under(ckpt_dir) if rel != MANIFEST}
    atomic_write_json(os.path.join(ckpt_dir, MANIFEST), {"files": files})


def verify_manifest(ckpt_dir: str) -> str | None:
    """None when every file MANIFEST.json lists is under `ckpt_dir` with its size and sha256 (files
    it does not list are ignored); else what is wrong, in a line (paths relative to `ckpt_dir`)."""
    try:
        with open(os.path.join(ckpt_dir, MANIFEST)) as f:
            files = json.load(f)["files"]
        wanted = {str(rel): (int(v["size"]), str(v["sha256"])) for rel, v in files.items()}
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    problems = []
    for rel, (size, sha) in sorted(wanted.items()):
        path = os.path.normpath(os.path.join(ckpt_dir, rel))
        if os.path.isabs(rel) or not path.startswith(os.path.join(os.path.normpath(ckpt_dir), "")):
            problems.append(f"{rel}: outside the checkpoint")
        elif not os.path.isfile(path):
            problems.append(f"{rel}: missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{rel}: {os.path.getsize(path)} bytes, manifest says {size}")
        elif file_sha256(path) != sha:
            problems.append(f"{rel}: sha256 differs from the manifest's")
    return "; ".join(problems) or None
