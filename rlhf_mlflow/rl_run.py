"""train_rl as an MLflow run: params, per-family metric curves, checkpoints, figures, a registered
policy version. The loop itself (train_rl.train_rl) knows nothing of MLflow."""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict

from . import data as D
from . import files as F
from . import model as M
from .errors import InputError
from .reward_wrapper import load_wrapper
from .train_rl import PATH_KEYS, RLConfig, train_rl
from .tracking import runs as T
from .tracking.policy_model import log_policy


def world_params(world_dir: str | None) -> dict:
    if not world_dir:
        return {}
    path = os.path.join(world_dir, "manifest.json")
    if not os.path.isfile(path):
        return {"world": os.path.abspath(world_dir)}
    with open(path) as f:
        m = json.load(f)
    return {"world": os.path.abspath(world_dir), "world_seed": m["seed"], "world_hash": m["world_hash"]}


def run_train_rl(cfg: RLConfig, world_dir: str | None = None, out: str | None = None,
                 run_name: str | None = None, register: bool = True,
                 echo: Callable[[str], None] = print, progress: bool = True, description: str | None = None,
                 tags: dict | None = None, select: Callable[[list[tuple[int, str]]], int] | None = None,
                 overwrite: bool = False) -> dict:
    """Train, log and register. Returns a summary (run id, model version, final metrics).

    `out` (optional) receives the checkpoints, run_config.json and log.jsonl; it must be empty or
    hold only this run's files (its marker .rlhf_run.json), unless `overwrite` deletes what it holds.
    `select`, given the checkpoints as (step, directory) in step order (the final one last), returns
    the step whose policy is registered (default: the final one); the version is tagged with it.
    """
    recipe = run_name or f"kl{cfg.kl_coef:g}-s{cfg.steps}"
    if out:
        _check_out(out, cfg, overwrite)
    # every input is read and validated before anything is logged; these records and these wrapper
    # bytes are what the run logs and uses
    prompts = D.read_jsonl(cfg.prompt_file)
    wrapper = load_wrapper(cfg.reward_wrapper)
    params = {**asdict(cfg), **world_params(world_dir)}
    if wrapper:
        params["reward_wrapper_sha256"] = wrapper.sha256
    with T.tracked_run("train_rl", params, tags={"rlhf.recipe": recipe, **(tags or {})}, run_name=recipe,
                       description=description) as run, \
            tempfile.TemporaryDirectory() as tmp:
        if out:
            F.claim_run_dir(out, run.info.run_id, overwrite)
        if wrapper:
            T.log_bytes(wrapper.source, os.path.basename(wrapper.path), "reward_wrapper")
        T.log_records_input(prompts, cfg.prompt_file, "training")
        T.log_json_artifact(asdict(cfg), "run_config.json")
        ckpt_root = out or os.path.join(tmp, "policy")
        bar = _progress(cfg.steps, progress)
        logger = T.MetricLogger()

        def on_log(step, metrics):
            logger(step, metrics)
            bar(step, metrics)

        saved = []

        def on_checkpoint(step, policy):
            path = os.path.join(out or tmp, f"step_{step}")
            M.save_policy(policy, policy.cfg, path)
            T.log_artifact(path, f"checkpoints/step_{step}")
            saved.append((step, path))

        try:
            result = train_rl(cfg, on_log=on_log, on_checkpoint=on_checkpoint, wrapper=wrapper, prompts=prompts)
        finally:  # the curves up to a failure are kept
            logger.flush()
            bar(None, None)
        M.save_policy(result.policy, result.policy_config, ckpt_root)
        T.log_artifact(ckpt_root, "checkpoints/final")
        if out:
            F.atomic_write_json(os.path.join(out, "run_config.json"), asdict(cfg))
            F.atomic_write_text(os.path.join(out, "log.jsonl"),
                                "".join(json.dumps({"step": step, **m}) + "\n" for step, m in result.history))
        from .figures import family_curves
        T.log_figure(family_curves(result.history), "figures/family_curves.png")
        summary = {"run_id": run.info.run_id, "recipe": recipe, "seconds": round(result.seconds, 1),
                   **{k: v for k, v in result.history[-1][1].items() if k.endswith("/balanced")}}
        if register:
            saved.append((cfg.steps, ckpt_root))
            step = cfg.steps if select is None else select(saved)
            path = dict(saved)[step]
            T.set_tags({"rlhf.registered_step": str(step)})
            version_tags = {"run_id": run.info.run_id, "recipe": recipe, "world_hash": params.get("world_hash", ""),
                            "checkpoint_step": str(step)}
            if wrapper:
                version_tags["reward_wrapper_sha256"] = wrapper.sha256
            info, version = log_policy(path, tags=version_tags)
            summary.update(model_id=info.model_id, model_version=version.version, registered_step=step)
            echo(f"registered rlhf-policy version {version.version} (run {run.info.run_id}, step {step})")
    return summary


def _check_out(out: str, cfg: RLConfig, overwrite: bool) -> None:
    """Before the run: `out` is writable and free (files.check_run_dir), and --overwrite would not
    delete one of the run's own inputs."""
    F.check_run_dir(out, overwrite=overwrite)
    root = os.path.join(os.path.abspath(out), "")
    for key in PATH_KEYS:
        path = getattr(cfg, key)
        if overwrite and path and os.path.join(os.path.abspath(path), "").startswith(root):
            raise InputError(f"--out {out} --overwrite would delete {key} {path}: choose another directory")
    if overwrite and os.path.join(os.getcwd(), "").startswith(root):
        raise InputError(f"--out {out} --overwrite would delete the current directory: choose another directory")


def _progress(total: int, enabled: bool):
    """A terminal progress bar on stderr when attached to a TTY; silent otherwise."""
    import sys
    if not (enabled and sys.stderr.isatty()):
        return lambda step, metrics: None
    from tqdm import tqdm
    bar = tqdm(total=total, unit="step", file=sys.stderr)
    state = {"last": 0}

    def update(step, metrics):
        if step is None:
            bar.close()
            return
        bar.update(step - state["last"])
        state["last"] = step
        bar.set_postfix(proxy=f"{metrics['proxy/balanced']:.3f}", kl=f"{metrics['kl/balanced']:.2f}")
    return update
