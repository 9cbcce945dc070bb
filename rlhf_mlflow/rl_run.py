"""train_rl as an MLflow run: params, per-family metric curves, checkpoints, figures, a registered
policy version. The loop itself (train_rl.train_rl) knows nothing of MLflow.

A run that died (a crash, SIGKILL, a lost machine) continues with `resume_train_rl(run_id)`: from its
last checkpoint (policy, Adam state, random streams), in the same MLflow run, logging only the metric
points the store does not hold yet, and ends FINISHED as if it had never stopped.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict

from . import checkpoint as CK
from . import model as M
from .config import from_dict
from .errors import InputError
from .train_rl import PATH_KEYS, Resume, RLConfig, train_rl
from .tracking import runs as T
from .tracking.policy_model import log_policy

CONFIG_ARTIFACT = "run_config.json"


def world_params(world_dir: str | None) -> dict:
    if not world_dir:
        return {}
    path = os.path.join(world_dir, "manifest.json")
    if not os.path.isfile(path):
        return {"world": os.path.abspath(world_dir)}
    with open(path) as f:
        m = json.load(f)
    return {"world": os.path.abspath(world_dir), "world_seed": m["seed"], "world_hash": m["world_hash"]}


def input_hashes(cfg: RLConfig) -> dict[str, str]:
    """`<key>_sha256` of every input file or checkpoint the config names (a resume checks them)."""
    out = {}
    for key in PATH_KEYS:
        path = getattr(cfg, key)
        if path and os.path.exists(path):
            out[f"{key}_sha256"] = CK.content_sha256(path)
    return out


def run_train_rl(cfg: RLConfig, world_dir: str | None = None, out: str | None = None,
                 run_name: str | None = None, register: bool = True,
                 echo: Callable[[str], None] = print, progress: bool = True, description: str | None = None,
                 tags: dict | None = None, select: Callable[[list[tuple[int, str]]], int] | None = None) -> dict:
    """Train, log and register. Returns a summary (run id, model version, final metrics).

    `select`, given the checkpoints as (step, directory) in step order (the final one last), returns
    the step whose policy is registered (default: the final one); the version is tagged with it.
    """
    recipe = run_name or f"kl{cfg.kl_coef:g}-s{cfg.steps}"
    params = {**asdict(cfg), **world_params(world_dir), **input_hashes(cfg)}
    with T.tracked_run("train_rl", params, tags={"rlhf.recipe": recipe, **(tags or {})}, run_name=recipe,
                       description=description) as run:
        if cfg.reward_wrapper and os.path.isfile(cfg.reward_wrapper):
            T.log_artifact(cfg.reward_wrapper, "reward_wrapper")
        if os.path.isfile(cfg.prompt_file):
            T.log_jsonl_input(cfg.prompt_file, "training")
        T.log_json_artifact(asdict(cfg), CONFIG_ARTIFACT)
        return _train(cfg, run.info.run_id, recipe, params.get("world_hash", ""), out, register, echo, progress,
                      select)


def resume_train_rl(run_id: str, out: str | None = None, register: bool = True,
                    echo: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Continue a train_rl run that died, from its last checkpoint, in the same MLflow run."""
    run = resumable_run(run_id)
    params = run.data.params
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _logged_config(run_id, tmp)
        changed = [f"{k} ({getattr(cfg, k[:-len('_sha256')])})" for k, v in input_hashes(cfg).items()
                   if params.get(k) not in (None, v)]
        missing = [k for k in PATH_KEYS if getattr(cfg, k) and not os.path.exists(getattr(cfg, k))]
        if missing or changed:
            raise InputError(f"run {run_id} cannot be resumed: "
                             + "; ".join((["missing inputs: " + ", ".join(f"{k} {getattr(cfg, k)}" for k in missing)]
                                          if missing else [])
                                         + (["inputs changed since it started: " + ", ".join(changed)] if changed else [])))
        resume = _last_checkpoint(run_id, tmp)
        start = resume.state.step if resume else 0
        echo(f"resuming run {run_id} at step {start} of {cfg.steps}"
             + ("" if resume else " (it saved no checkpoint: from the start)"))
        T.use_experiment_of(run)
        stored = T.stored_steps(run_id)
        with T.tracked_run("train_rl", tags={"rlhf.resumed_from_step": str(start)}, run_id=run_id):
            return _train(cfg, run_id, run.data.tags.get("rlhf.recipe", run.info.run_name),
                          params.get("world_hash", ""), out, register, echo, progress, None, resume, stored)


def resumable_run(run_id: str):
    """The run, if it is a train_rl run that stopped before finishing; else InputError saying why."""
    run = T.get_run(run_id)
    tags = run.data.tags
    if tags.get("rlhf.step") != "train_rl":
        raise InputError(f"run {run_id} is a {tags.get('rlhf.step', 'non-rlhf_mlflow')!r} run; only train_rl runs resume")
    status = run.info.status
    if status == "FINISHED":
        raise InputError(f"run {run_id} already FINISHED: nothing to resume")
    if status == "RUNNING":
        state = T.process_state(tags)
        if state == "alive":
            raise InputError(f"run {run_id} is still running (pid {tags['rlhf.pid']} on this machine)")
        if state == "unknown":
            raise InputError(f"run {run_id} is RUNNING on host {tags.get('rlhf.host', '?')}: if its process is gone, "
                             "run `rlhf-mlflow runs --repair` there first")
    return run


def _logged_config(run_id: str, tmp: str) -> RLConfig:
    path = T.download_artifact(run_id, CONFIG_ARTIFACT, tmp)
    if path is None:
        raise InputError(f"run {run_id} cannot be resumed: it logged no {CONFIG_ARTIFACT}")
    with open(path) as f:
        return from_dict(RLConfig, json.load(f), f"run {run_id}'s {CONFIG_ARTIFACT}")


def _last_checkpoint(run_id: str, tmp: str) -> Resume | None:
    """The latest `checkpoints/step_N` with a training state, downloaded; None when there is none."""
    steps = sorted((int(name[len("step_"):]) for name in T.list_artifact_names(run_id, "checkpoints")
                    if name.startswith("step_") and name[len("step_"):].isdigit()), reverse=True)
    for step in steps:
        names = T.list_artifact_names(run_id, f"checkpoints/step_{step}")
        if {CK.STATE_TENSORS, CK.STATE_META, M.WEIGHTS, "config.json"} <= set(names):
            path = T.download_artifact(run_id, f"checkpoints/step_{step}", tmp)
            return Resume(path, CK.load_train_state(path))
    return None


def _train(cfg: RLConfig, run_id: str, recipe: str, world_hash: str, out: str | None, register: bool,
           echo: Callable[[str], None], progress: bool, select, resume: Resume | None = None,
           stored: dict[str, int] | None = None) -> dict:
    """The training part of a train_rl run (new or resumed), inside its active MLflow run."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt_root = out or os.path.join(tmp, "policy")
        bar = _progress(cfg.steps, progress, resume.state.step if resume else 0)
        logger = T.MetricLogger(stored=stored)

        def on_log(step, metrics):
            logger(step, metrics)
            bar(step, metrics)

        saved = []

        def on_checkpoint(step, policy, state):
            logger.flush(synchronous=True)  # every point up to here is stored before the checkpoint exists
            path = os.path.join(out or tmp, f"step_{step}")
            save_checkpoint(policy, state, path)
            T.log_artifact(path, f"checkpoints/step_{step}")
            saved.append((step, path))

        try:
            result = train_rl(cfg, on_log=on_log, on_checkpoint=on_checkpoint, resume=resume)
        finally:  # the curves up to a failure are kept
            logger.flush()
            bar(None, None)
        M.save_policy(result.policy, result.policy_config, ckpt_root)
        T.log_artifact(ckpt_root, "checkpoints/final")
        if out:
            with open(os.path.join(out, CONFIG_ARTIFACT), "w") as f:
                json.dump(asdict(cfg), f, indent=1)
            with open(os.path.join(out, "log.jsonl"), "w") as f:
                for step, m in result.history:
                    f.write(json.dumps({"step": step, **m}) + "\n")
        from .figures import family_curves
        T.log_figure(family_curves(result.history), "figures/family_curves.png")
        summary = {"run_id": run_id, "recipe": recipe, "seconds": round(result.seconds, 1),
                   **{k: v for k, v in result.history[-1][1].items() if k.endswith("/balanced")}}
        if register:
            saved.append((cfg.steps, ckpt_root))
            step = cfg.steps if select is None else select(saved)
            path = dict(saved)[step]
            T.set_tags({"rlhf.registered_step": str(step)})
            info, version = log_policy(path, tags={"run_id": run_id, "recipe": recipe, "world_hash": world_hash,
                                                   "checkpoint_step": str(step)})
            summary.update(model_id=info.model_id, model_version=version.version, registered_step=step)
            echo(f"registered rlhf-policy version {version.version} (run {run_id}, step {step})")
    return summary


def save_checkpoint(policy: M.Policy, state, path: str) -> None:
    """The policy and its training state in one directory that appears whole or not at all."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".ckpt-", dir=parent)
    try:
        M.save_policy(policy, policy.cfg, tmp)
        CK.save_train_state(state, tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _progress(total: int, enabled: bool, start: int = 0):
    """A terminal progress bar on stderr when attached to a TTY; silent otherwise."""
    import sys
    if not (enabled and sys.stderr.isatty()):
        return lambda step, metrics: None
    from tqdm import tqdm
    bar = tqdm(total=total, initial=start, unit="step", file=sys.stderr)
    state = {"last": start}

    def update(step, metrics):
        if step is None:
            bar.close()
            return
        bar.update(step - state["last"])
        state["last"] = step
        bar.set_postfix(proxy=f"{metrics['proxy/balanced']:.3f}", kl=f"{metrics['kl/balanced']:.2f}")
    return update
