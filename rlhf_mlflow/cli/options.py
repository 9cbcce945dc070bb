"""What several commands share: the world option, one click option per RL config key, the RL config
from the command line, guardrail thresholds, numeric option types that refuse NaN and infinity, and
JSON output. Light to import: steps (torch, MLflow) are imported by the commands that run them."""
from __future__ import annotations

import dataclasses
import json
import math
import os

import click
from click.core import ParameterSource

from rlhf_mlflow.core.config import MAX_SEED, field_docs
from rlhf_mlflow.core.errors import InputError, parse_json
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.training.rl_config import (
    PATH_KEYS,
    RLConfig,
    check_fields,
    load_rl_config,
    parse_overrides,
)


class Finite(click.FloatRange):
    """A float option in a range that is also finite: click's FloatRange lets `nan` through (it compares
    false with every bound) and `inf` where there is no upper bound."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


SEED = click.IntRange(0, MAX_SEED)
"""A seed option: an integer in [0, 2^32 - 1] (core/config.py MAX_SEED)."""

world_option = click.option("--world", default=None,
                            help="World directory (default: the default world, built on first use).")


def overwrite_option(what: str, more: str = ""):
    """--overwrite for a command that writes a directory (the one output rule, steps/outputs.py): it
    replaces `what` at --out, never files no run marked; a flag that also takes true|false, as
    `mlflow run -P overwrite=...` passes it."""
    return click.option("--overwrite", type=click.BOOL, is_flag=False, flag_value=True, default=False,
                        show_default=True, help=f"Replace {what} at --out (as its marker says; never files no run "
                        f"marked, nor another command's output){more}; `--overwrite` alone or `--overwrite true|false`.")


def echo_err(message: str) -> None:
    """Progress on stderr (silent under `rlhf-mlflow --quiet`)."""
    from rlhf_mlflow.core.process import quiet
    if not quiet():
        click.echo(message, err=True)


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=1))


def resolve_world(world: str | None) -> WorldPaths:
    """The given world directory, or the default world (seed 0, default spec), built once on first use."""
    if world:
        return WorldPaths.at(world)
    from rlhf_mlflow.steps.build_world import (
        default_world,  # builds it (a run) on first use
    )
    return default_world(progress=click.echo)


def rl_options(fn):
    """One click option per RLConfig field: same name (dashes for underscores), type and default; the
    field's docstring is its help."""
    docs = field_docs(RLConfig)
    for f in reversed(dataclasses.fields(RLConfig)):
        default = "" if f.default is None else f.default
        kind = str if f.name == "family_weights" else type(default)
        if f.name == "family_weights":
            default = ""
        fn = click.option(f"--{f.name.replace('_', '-')}", f.name, type=kind, default=default,
                          show_default=True, help=docs[f.name])(fn)
    return fn


def check_rl_options(ctx: click.Context, overrides: tuple[str, ...], options: dict) -> None:
    """Every numeric RL option and --override given, checked as RLConfig checks it (finite, in its range),
    before the command resolves (or builds) a world or starts a run."""
    check_fields({**parse_overrides(overrides), **{n: v for n, v in options.items()
                                                   if ctx.get_parameter_source(n) != ParameterSource.DEFAULT}})


def explicit_options(ctx: click.Context, options: dict, world: WorldPaths | None) -> dict:
    """The RL options given on the command line, typed; relative paths resolve against the world."""
    out = {}
    for name, value in options.items():
        if ctx.get_parameter_source(name) == ParameterSource.DEFAULT:
            continue
        if name in ("family_weights", "reward_wrapper", "policy_init", "watch_gold", "watch_correction",
                    "reward_ensemble") and value == "":
            value = None
        elif name == "family_weights":
            value = parse_json(value, "--family-weights")
        elif name in PATH_KEYS and world and not os.path.isabs(value) and not os.path.exists(value):
            value = os.path.join(world.root, value)  # a world's own file (policy, data/...), unless one is here
        out[name] = value
    return out


def rl_config(ctx: click.Context, world: WorldPaths | None, config_path: str | None, overrides: tuple[str, ...],
              options: dict) -> RLConfig:
    """The recipe. Precedence: explicit options > --override > config file > defaults. Without --config
    the world's configs/default.json is the base; relative paths in options resolve against the world
    (where the defaults point), in --override against the current directory."""
    given = {**parse_overrides(overrides), **explicit_options(ctx, options, world)}
    return load_rl_config(config_path or world.config, given, root=None if config_path else world.root)


def world_for_config(world: str | None, config_path: str | None) -> WorldPaths | None:
    """The world a command's recipe belongs to: --world, else the default world unless --config is given."""
    if config_path:
        return WorldPaths.at(world) if world else None
    return resolve_world(world)


def guardrail_overrides(text: str | None, repeated: tuple[str, ...] = ()) -> dict:
    """`--guardrails a=1,b=2` (one string, as the MLproject passes it) and `--guardrail a=1` (repeatable,
    as `sweep` takes it) merged; the repeated form wins on a key given both ways."""
    out = {}
    for item in (text or "").split(",") + list(repeated):
        if not item.strip():
            continue
        if "=" not in item:
            raise InputError(f"--guardrails {item!r}: expected key=value[,key=value], e.g. max_family_kl=4")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def given(ctx: click.Context, names) -> list[str]:
    """The parameters among `names` that the command line (not a default) set."""
    return [n for n in names if ctx.get_parameter_source(n) != ParameterSource.DEFAULT]
