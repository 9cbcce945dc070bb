"""Reading an RL recipe: a JSON config file plus `key=value` overrides -> a validated RLConfig.

Relative paths inside a config file resolve against its fixture root (the directory above
`configs/`, else the file's own directory); relative paths given on the command line resolve
against the current directory.
"""
from __future__ import annotations

import os
from .config import from_dict, parse_override
from .errors import InputError, read_json
from .train_rl import PATH_KEYS, RLConfig


def fixture_root(config_path: str) -> str:
    d = os.path.dirname(os.path.abspath(config_path))
    return os.path.dirname(d) if os.path.basename(d) == "configs" else d


def load_rl_config(config_path: str | None, overrides: list[str] = (), root: str | None = None) -> RLConfig:
    """Config file (optional) + overrides -> RLConfig with absolute paths."""
    base: dict = {}
    if config_path:
        base = read_json(config_path, "config file not found")
        if not isinstance(base, dict):
            raise InputError(f"{config_path}: expected a JSON object of config keys")
    where = config_path or "config"
    file_root = root or (fixture_root(config_path) if config_path else os.getcwd())
    merged = {k: v for k, v in base.items() if v is not None}
    for k in PATH_KEYS:
        if isinstance(merged.get(k), str) and not os.path.isabs(merged[k]):
            merged[k] = os.path.normpath(os.path.join(file_root, merged[k]))
    for text in overrides:
        k, v = parse_override(text)
        if k in PATH_KEYS and isinstance(v, str):
            v = os.path.abspath(v)
        merged[k] = v
    if overrides:
        where = f"{where} with overrides"
    cfg = from_dict(RLConfig, merged, where)
    return cfg.resolved(file_root)


def recipe_overrides(recipe: dict) -> list[str]:
    """A recipe's {key: value} overrides as `key=<json>` strings for load_rl_config."""
    import json
    return [f"{k}={json.dumps(v)}" for k, v in recipe.items()]
