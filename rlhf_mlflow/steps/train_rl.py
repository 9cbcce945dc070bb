"""train_rl as an MLflow run: params, per-family metric curves, checkpoints, figures, a registered
policy version. The loop itself (train_rl.train_rl) knows nothing of MLflow.

A run that died (a crash, SIGKILL, a lost machine) continues with `resume_train_rl(run_id)`: from its
newest complete checkpoint (policy, Adam state, random streams: train_rl_checkpoints.py), in the same
MLflow run, logging only the metric points the store does not hold yet, and ends FINISHED as if it had
never stopped.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

from rlhf_mlflow.core import checkpoint as CK
from rlhf_mlflow.core import files as F
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.config import from_dict
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.process import process_state
from rlhf_mlflow.core.reward_wrapper import load_wrapper
from rlhf_mlflow.core.world_paths import WorldPaths, world_of_reference
from rlhf_mlflow.steps.progress import training_progress
from rlhf_mlflow.steps.selection import WATCH_SELECT, select_param
from rlhf_mlflow.steps.train_rl_checkpoints import last_checkpoint, upload, write_checkpoint
from rlhf_mlflow.steps.train_rl_watch import WATCH_FILES, RunWatch
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking import world_record as WR
from rlhf_mlflow.tracking.metric_logger import MetricLogger, stored_steps
from rlhf_mlflow.tracking.policy_model import log_policy
from rlhf_mlflow.training.batched import Seat
from rlhf_mlflow.training.rl_config import PATH_KEYS, RLConfig
from rlhf_mlflow.training.train_rl import Resume, train_rl

CONFIG_ARTIFACT = "run_config.json"
STEP = "train_rl"
"""The step's name: its runs' tag `rlhf.step`, and the command its --out's marker names."""
def input_hashes(cfg: RLConfig) -> dict[str, str]:
    """`<key>_sha256` of every input file or checkpoint the config names (a resume checks them)."""
    out = {}
    for key in PATH_KEYS:
        path = getattr(cfg, key)
        if path and os.path.exists(path):
            out[f"{key}_sha256"] = CK.content_sha256(path)
    return out


def run_train_rl(cfg: RLConfig, world: WorldPaths | None = None, out: str | None = None,
                 run_name: str | None = None, register: bool = True,
                 echo: Callable[[str], None] = print, progress: bool | float = True, description: str | None = None,
                 tags: dict | None = None, select: Callable[[list[tuple[int, str]]], int] | str | None = None,
                 overwrite: bool = False, seat: Seat | None = None) -> dict:
    """Train, log and register. Returns a summary (run id, model version, final metrics).

    `out` (optional) receives the checkpoints, run_config.json and log.jsonl; it must be empty or
    hold only this run's files (its marker .rlhf_run.json), unless `overwrite` deletes what it holds.
    `select`, given the checkpoints as (step, directory) in step order (the final one last), returns
    the step whose policy is registered (default: the final one); the version is tagged with it.
    `select="watch_best"` (or early_stop=stop) registers the watch's best checkpoint instead (the best
    estimated balanced truth where the expert set vouches for every family, train_rl_watch.py; needs
    watch_every > 0), `select="watch_proposal"` its best estimate vouched for or not (for a caller that
    certifies it with labels); the run's tag `rlhf.select` keeps that choice for a resume.
    `progress`: True, a bar on a terminal; a number, a line every that many seconds; False, nothing.
    `seat` (training/batched.py): the run trains as a member of that batch, in this thread.
    """
    recipe = run_name or default_name(cfg)
    if out:
        _check_out(out, cfg, overwrite)
    # every input is read and validated before anything is logged; these records and these wrapper
    # bytes are what the run logs and uses
    prompts = D.read_jsonl(cfg.prompt_file)
    if cfg.watch_every:  # the watch reads its expert set again in the run
        D.read_jsonl(cfg.watch_gold, labelled=True, scale=D.EXPERT)
    wrapper = load_wrapper(cfg.reward_wrapper)
    world = world or world_of_reference(cfg.policy_ref)
    params = {**asdict(cfg), **(WR.world_params(world) if world else {}), **input_hashes(cfg),
              "select": select_param(select, cfg.early_stop)}
    if wrapper:
        params["reward_wrapper_sha256"] = wrapper.sha256
    tags = {"rlhf.recipe": recipe, "rlhf.register": str(register).lower(),
            **({"rlhf.select": select} if select in WATCH_SELECT else {}), **(tags or {})}
    with T.tracked_run("train_rl", params, tags=tags, run_name=recipe,
                       description=description) as run:
        if out:
            F.claim_out_dir(out, F.Owner(STEP, run.info.run_id), overwrite)
        if wrapper:
            T.log_bytes(wrapper.source, os.path.basename(wrapper.path), "reward_wrapper")
        T.log_records_input(prompts, cfg.prompt_file, "training")
        T.log_json_artifact(asdict(cfg), CONFIG_ARTIFACT)
        return _train(Job(cfg, run.info.run_id, recipe, params.get("world_hash", ""), prompts, wrapper, seat),
                      out, register, echo, progress, select)


def resume_train_rl(run_id: str, out: str | None = None, register: bool = True,
                    echo: Callable[[str], None] = print, progress: bool = True, seat: Seat | None = None) -> dict:
    """Continue a train_rl run that died, from its newest whole checkpoint, in the same MLflow run. A run
    started without registering (tag `rlhf.register` false) does not register when resumed either."""
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
        resume = last_checkpoint(run_id, cfg, tmp, echo)
        start = resume.state.step if resume else 0
        echo(f"resuming run {run_id} at step {start} of {cfg.steps}"
             + ("" if resume else " (no complete checkpoint: from the start)"))
        job = Job(cfg, run_id, run.data.tags.get("rlhf.recipe", run.info.run_name), params.get("world_hash", ""),
                  D.read_jsonl(cfg.prompt_file), load_wrapper(cfg.reward_wrapper), seat)
        T.use_experiment_of(run)
        stored = stored_steps(run_id)
        with T.tracked_run("train_rl", tags={"rlhf.resumed_from_step": str(start)}, run_id=run_id):
            if out:
                F.claim_out_dir(out, F.Owner(STEP, run_id))
            select = run.data.tags.get("rlhf.select") if run.data.tags.get("rlhf.select") in WATCH_SELECT else None
            if register and run.data.tags.get("rlhf.register") == "false":
                echo(f"not registering: run {run_id} was started with --no-register")
                register = False
            return _train(job, out, register, echo, progress, select, resume, stored)


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
        state = process_state(tags)
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


@dataclass(frozen=True)
class Job:
    """What a (new or resumed) train_rl run trains with: its config, run, recipe and validated inputs."""
    cfg: RLConfig
    run_id: str
    recipe: str
    world_hash: str
    prompts: list[dict]
    wrapper: object | None
    seat: Seat | None = None
    """A batch's seat: the run trains as a member of that batch (training/batched.py)."""


def _train(job: Job, out: str | None, register: bool, echo: Callable[[str], None], progress: bool, select,
           resume: Resume | None = None, stored: dict[str, int] | None = None) -> dict:
    """The training part of a train_rl run (new or resumed), inside its active MLflow run."""
    cfg, run_id = job.cfg, job.run_id
    with tempfile.TemporaryDirectory() as tmp:
        bar = training_progress(cfg.steps, progress, resume.state.step if resume else 0, job.recipe)
        logger = MetricLogger(stored=stored)

        def on_log(step, metrics):
            logger(step, charted(metrics))
            bar(step, metrics)

        saved = []
        watch = RunWatch(cfg, logger, tmp, proposal=select == "watch_proposal", name=job.recipe) \
            if cfg.watch_every else None
        if watch is not None and resume is not None:
            watch.restore(resume.policy_dir)

        def on_checkpoint(step, policy, state):
            logger.flush(synchronous=True)  # every point up to here is stored before the checkpoint exists
            path = os.path.join(out or tmp, f"step_{step}")
            write_checkpoint(path, policy, state, watch)
            upload(path, f"step_{step}")
            saved.append((step, path))

        try:
            result = train_rl(cfg, on_log=on_log, on_checkpoint=on_checkpoint, wrapper=job.wrapper,
                              prompts=job.prompts, resume=resume, on_watch=watch, seat=job.seat)
        finally:  # the curves up to a failure are kept
            logger.flush()
            bar(None, None)
        final = os.path.join(tmp, "final")  # its own directory: out's root also holds step_N/
        write_checkpoint(final, result.policy)
        upload(final, "final")
        if out:
            M.save_policy(result.policy, result.policy_config, out)
            F.atomic_write_json(os.path.join(out, CONFIG_ARTIFACT), asdict(cfg))
            F.atomic_write_text(os.path.join(out, "log.jsonl"),
                                "".join(json.dumps({"step": step, **m}) + "\n" for step, m in result.history))
        from rlhf_mlflow.steps.figures import family_curves
        T.log_figure(family_curves(result.history), "figures/family_curves.png")
        last = cfg.steps if result.stopped_at is None else result.stopped_at
        summary = {"run_id": run_id, "recipe": job.recipe, "seconds": round(result.seconds, 1), "last_step": last,
                   **{k: v for k, v in result.history[-1][1].items() if k.endswith("/balanced")}}
        if watch is not None:
            watch.finish()
            summary["watch_best_step"] = watch.best[0] if watch.best else None
        if register:
            summary.update(_register(job, _checkpoints(saved, watch, last, final), last,
                                     _watch_select(job, watch, select), echo))
    return summary


def _checkpoints(saved: list[tuple[int, str]], watch, last: int, final: str) -> list[tuple[int, str]]:
    """Every checkpoint as (step, directory) in step order, the watch's best among them, the final last."""
    best = [watch.best] if watch is not None and watch.best and watch.best[0] not in dict(saved) else []
    return sorted(saved + best, key=lambda c: c[0]) + [(last, final)]


def _watch_select(job: Job, watch, select):
    """Under early_stop=stop or `select="watch_best"`, the watch's best checkpoint; else `select`."""
    if watch is not None and watch.best and (select in WATCH_SELECT or job.cfg.early_stop == "stop"):
        return lambda saved: watch.best[0]
    return None if select in WATCH_SELECT else select


def _register(job: Job, saved: list[tuple[int, str]], last: int, select, echo: Callable[[str], None]) -> dict:
    """Register the checkpoint `select` picks (the final one by default) as a new version."""
    step = last if select is None else select(saved)
    T.set_tags({"rlhf.registered_step": str(step)})
    # few tags (the registry's page shows them on every row): the run (the version's own run_id) holds
    # the rest, the reward wrapper's sha256 among its params
    version_tags = {"recipe": job.recipe, "world_hash": job.world_hash, "checkpoint_step": str(step)}
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint without the watch's files (not the model's)
        policy_dir = os.path.join(tmp, os.path.basename(dict(saved)[step]))
        shutil.copytree(dict(saved)[step], policy_dir, ignore=shutil.ignore_patterns(*WATCH_FILES, CK.MANIFEST))
        info, version = log_policy(policy_dir, tags=version_tags, name=_model_name(job.recipe))
    echo(f"registered rlhf-policy version {version.version} (run {job.run_id}, step {step})")
    return {"model_id": info.model_id, "model_version": version.version, "registered_step": step}


def default_name(cfg: RLConfig) -> str:
    """A run's name when none is given, in the seed's convention (kl05-s800 is kl 0.5, kl005-s1200 kl
    0.05): the KL coefficient's digits without the point, then the steps."""
    return f"kl{format(cfg.kl_coef, 'g').replace('.', '')}-s{cfg.steps}"


PER_FAMILY = ("proxy", "kl", "spread")
"""The training batch's numbers charted per family (`train/proxy/dune`, and balanced): the UI's first
sections, train/kl and train/proxy; with reward_ensemble, train/spread (the members' disagreement)."""


def charted(metrics: dict) -> dict:
    """The training report's numbers worth a chart each, by the names the run logs them under: PER_FAMILY
    per family; of the rest the balanced means and the scalars, in one section after those
    (`entropy/balanced` -> `train/stats/entropy`, `loss` -> `train/stats/loss`; per family the others
    are in figures/family_curves.png)."""
    out = {}
    for key, value in metrics.items():
        name, _, family = key.partition("/")
        if name in PER_FAMILY:
            out[MN.TRAIN + key] = value
        elif family in ("", "balanced"):
            out[MN.TRAIN_STATS + name] = value
    return out


def _model_name(recipe: str) -> str:
    """The LoggedModel's name: the recipe, in the characters MLflow allows in a model name (no `.`,
    `/`, `:`, `%` or quotes: a.b -> a_b)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", recipe).strip("_-") or "policy"


def _check_out(out: str, cfg: RLConfig, overwrite: bool) -> None:
    """Before the run: `out` is none of the run's inputs and holds none, and the one output rule lets a
    new train_rl run write there (outputs.check_out_dir)."""
    from rlhf_mlflow.steps.outputs import check_out_dir
    check_out_dir(out, STEP, {key: getattr(cfg, key) for key in PATH_KEYS}, overwrite=overwrite)
