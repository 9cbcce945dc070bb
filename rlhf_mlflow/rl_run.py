"""train_rl as an MLflow run: params, per-family metric curves, checkpoints, figures, a registered
policy version. The loop itself (train_rl.train_rl) knows nothing of MLflow."""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict

from . import model as M
from .train_rl import RLConfig, train_rl
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
                 tags: dict | None = None, select: Callable[[list[tuple[int, str]]], int] | None = None) -> dict:
    """Train, log and register. Returns a summary (run id, model version, final metrics).

    `select`, given the checkpoints as (step, directory) in step order (the final one last), returns
    the step whose policy is registered (default: the final one); the version is tagged with it.
    """
    recipe = run_name or f"kl{cfg.kl_coef:g}-s{cfg.steps}"
    params = {**asdict(cfg), **world_params(world_dir)}
    if cfg.reward_wrapper:
        params["reward_wrapper_sha256"] = T.file_sha256(cfg.reward_wrapper) if os.path.isfile(cfg.reward_wrapper) else None
    with T.tracked_run("train_rl", params, tags={"rlhf.recipe": recipe, **(tags or {})}, run_name=recipe,
                       description=description) as run, \
            tempfile.TemporaryDirectory() as tmp:
        if cfg.reward_wrapper and os.path.isfile(cfg.reward_wrapper):
            T.log_artifact(cfg.reward_wrapper, "reward_wrapper")
        if os.path.isfile(cfg.prompt_file):
            T.log_jsonl_input(cfg.prompt_file, "training")
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
            result = train_rl(cfg, on_log=on_log, on_checkpoint=on_checkpoint)
        finally:  # the curves up to a failure are kept
            logger.flush()
            bar(None, None)
        M.save_policy(result.policy, result.policy_config, ckpt_root)
        T.log_artifact(ckpt_root, "checkpoints/final")
        if out:
            with open(os.path.join(out, "run_config.json"), "w") as f:
                json.dump(asdict(cfg), f, indent=1)
            with open(os.path.join(out, "log.jsonl"), "w") as f:
                for step, m in result.history:
                    f.write(json.dumps({"step": step, **m}) + "\n")
        from .figures import family_curves
        T.log_figure(family_curves(result.history), "figures/family_curves.png")
        summary = {"run_id": run.info.run_id, "recipe": recipe, "seconds": round(result.seconds, 1),
                   **{k: v for k, v in result.history[-1][1].items() if k.endswith("/balanced")}}
        if register:
            saved.append((cfg.steps, ckpt_root))
            step = cfg.steps if select is None else select(saved)
            path = dict(saved)[step]
            T.set_tags({"rlhf.registered_step": str(step)})
            info, version = log_policy(path, tags={"run_id": run.info.run_id, "recipe": recipe,
                                                   "world_hash": params.get("world_hash", ""),
                                                   "checkpoint_step": str(step)})
            summary.update(model_id=info.model_id, model_version=version.version, registered_step=step)
            echo(f"registered rlhf-policy version {version.version} (run {run.info.run_id}, step {step})")
    return summary


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
