"""Safetensors checkpoints with a config.json beside them (the seed's layout). Never unpickles.

A checkpoint appears whole or not at all: a directory of its own is written beside its target and
renamed into place. In a directory that holds other files too (train-rl's --out, the final policy
beside step_N/ and log.jsonl), config.json goes first and comes back last, after the weights:
loaders read config.json first, so a half-written checkpoint is no checkpoint.
"""
from __future__ import annotations

import json
import os

import torch.nn as nn
from safetensors.torch import load_file, save, save_file

from rlhf_mlflow.core import vocab as V
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
    return cfg


def check_config_value(path: str, key: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{path}: {key!r} must be a positive integer, got {value!r}")
    if key in FIXED and value != FIXED[key][0]:
        want, why = FIXED[key]
        raise InputError(f"{path}: {key!r} must be {want} ({why}), got {value!r}")


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


def content_sha256(path: str) -> str:
    """sha256 of a file's bytes, or of a checkpoint directory's config.json and top-level weights (what
    loading it reads; other files beside them do not count)."""
    import hashlib
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(path) if n == "config.json" or n.endswith(".safetensors")):
        with open(os.path.join(path, name), "rb") as f:
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()
