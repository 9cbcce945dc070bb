"""Resuming a `main` that stopped (SIGTERM, a crash): `main --resume` reuses what it finished and runs the rest.

`--out` holds main_state.json: the settings main runs with (world hash, steps scale, label budget, rounds,
guardrails), the main runs that worked on it (the first, then each resume), a journal of what they
finished, and whether main finished; it is main's marker in the one output rule (steps/outputs.py). A
resume with other settings is refused naming the option; a fresh main (no --resume) refuses an --out
whose main did not finish, and replaces a finished main's directory only with --overwrite (its runs
logged what it held). What a resume reuses, and how it knows each is whole:
- expert labels: every labels-*.jsonl in --out (written whole) counts as spent and is not bought again;
- the diagnostic and its correction, each candidate's evaluation (dev_eval, certify, its label
  purchases) and grade: the journal; a release: the version's `release.decision` (never decided twice);
- a candidate: a train_rl run of an earlier main run that registered a version is that version; one that
  stopped before registering continues from its newest complete checkpoint (`resume_train_rl`);
- a later round: rounds.json (finished rounds); its repair labels (labels-r<r>-*.jsonl); its repair, when
  reward_model_r<r> holds the files of a version its round's repair_rm run registered and the gate decided.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from rlhf_mlflow.core import files as F
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.errors import InputError, read_json
from rlhf_mlflow.core.files import atomic_write_json
from rlhf_mlflow.core.process import process_state
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.grade import run_grade
from rlhf_mlflow.steps.main.candidates import TrainJob, train_all
from rlhf_mlflow.steps.outputs import check_out_dir
from rlhf_mlflow.steps.release import run_release
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import rm_registry as RMR
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.repair import repair as repair_store

STATE = F.MAIN_STATE
STEP = "main"
OPTIONS = {"world_hash": "--world", "steps_scale": "--steps-scale", "label_budget": "--label-budget",
           "rounds": "--rounds", "guardrails": "--guardrail"}
"""The settings a resume must share with the main it continues, and the option that sets each."""
DECIDED = ("promoted", "refused", "superseded")


class MainStateError(InputError):
    """main's own refusal of an --out (no main to resume there, or one that did not finish): a usage error."""


class SettingsMismatch(InputError):
    """A resume asked for other settings than the main it continues ran with."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.options = [option for option, _ in problems]
        super().__init__("main --resume continues a main with its own settings: "
                         + "; ".join(why for _, why in problems))


def settings(world: WorldPaths, steps_scale: float, label_budget: int, rounds: int, guardrails: dict | None) -> dict:
    """What a resume must match (and the world's path, which it may not)."""
    return json.loads(json.dumps({"world": world.root, "world_hash": world.build_hash(), "steps_scale": float(steps_scale),
                                  "label_budget": int(label_budget), "rounds": int(rounds),
                                  "guardrails": dict(sorted((guardrails or {}).items()))}))


@dataclass
class MainState:
    path: str
    settings: dict
    runs: list[str] = field(default_factory=list)
    """main runs that worked on this --out, the first one first."""
    done: dict = field(default_factory=dict)
    finished: bool = False

    def save(self) -> None:
        atomic_write_json(self.path, {k: v for k, v in asdict(self).items() if k != "path"})

    def mark(self, key: str, value=True) -> None:
        self.done[key] = value
        self.save()

    @property
    def earlier(self) -> list[str]:
        """The main runs before this one (empty unless resuming)."""
        return self.runs[:-1]


def read_state(out_dir: str) -> MainState | None:
    path = os.path.join(out_dir, STATE)
    if not os.path.isfile(path):
        return None
    raw = read_json(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("settings"), dict):
        raise MainStateError(f"{path}: not a main's state (expected an object with 'settings')")
    return MainState(path, raw["settings"], raw.get("runs", []), raw.get("done", {}), raw.get("finished", False))


def mismatches(stored: dict, wanted: dict) -> list[tuple[str, str]]:
    """(option, why) for each setting a resume would change."""
    show = lambda k, s: s["world"] + f" (world {s['world_hash']})" if k == "world_hash" else json.dumps(s[k])  # noqa: E731
    return [(option, f"{option} {show(key, wanted)}: the stopped main ran with {show(key, stored)}")
            for key, option in OPTIONS.items() if stored.get(key) != wanted[key]]


def resumable(out_dir: str) -> MainState:
    """The state of the unfinished main in `out_dir`, or InputError saying why there is none."""
    state = read_state(out_dir)
    if state is None:
        raise MainStateError(f"--resume: --out {out_dir} holds no main to resume (no {STATE})")
    if state.finished:
        raise MainStateError(f"--resume: the main in --out {out_dir} (run {state.runs[-1]}) finished: nothing to resume")
    return state


def refuse_unfinished(out_dir: str) -> None:
    """A fresh main must not start over a main that did not finish: its labels would be bought again."""
    state = read_state(out_dir)
    if state is not None and state.runs and not state.finished:
        raise MainStateError(f"--out {out_dir} holds a main that did not finish (run {state.runs[-1]}): "
                             "continue it with --resume, or choose another --out (or remove this one) to start over")


def check_out(out_dir: str, reads: dict[str, str | None] | None, resume: bool, overwrite: bool
              ) -> tuple[str, MainState | None]:
    """main's --out, before any run: main's own refusals first (MainStateError: a resume needs a main
    that did not finish there, a fresh main refuses one: its labels would be bought again); then the
    one output rule (outputs.check_out_dir): new or empty, the stopped main's when resuming, or with
    `overwrite` a finished main's. Returns the absolute path and the state a resume continues."""
    if resume and overwrite:
        raise MainStateError("--resume continues the main in --out and --overwrite starts one over: pass one of them")
    state = resumable(out_dir) if resume else None
    if not resume:
        refuse_unfinished(out_dir)
    target = check_out_dir(out_dir, STEP, reads, state.runs[-1] if state and state.runs else None, overwrite)
    return target, state


def begin(out_dir: str, wanted: dict, resume: bool, echo: Callable[[str], None], overwrite: bool = False) -> MainState:
    """The state this main works with: the stopped main's (checked) when resuming, else a new one, in a
    directory that is new, empty or (with `overwrite`) a finished main's, emptied first."""
    if not resume:
        refuse_unfinished(out_dir)
        F.claim_out_dir(out_dir, F.Owner(STEP), overwrite, mark=False)  # main_state.json is main's marker
        state = MainState(os.path.join(out_dir, STATE), wanted)
        state.save()
        return state
    state = resumable(out_dir)
    problems = mismatches(state.settings, wanted)
    if problems:
        raise SettingsMismatch(problems)
    _check_stopped(state, echo)
    return state


def _check_stopped(state: MainState, echo: Callable[[str], None]) -> None:
    """The main being resumed is not still going; runs whose process died (SIGKILL) are settled first
    (`runs --repair`: RUNNING -> FAILED, a stale release lock, a release cut short)."""
    last = T.get_run(state.runs[-1]) if state.runs else None
    if last is not None and last.info.status == "RUNNING" and process_state(last.data.tags) != "gone":
        raise InputError(f"--resume: main run {last.info.run_id} is still RUNNING "
                         f"(pid {last.data.tags.get('rlhf.pid')} on {last.data.tags.get('rlhf.host')})")
    for line in repair_store():
        echo(f"resume: {line}")


def labels_in(path: str) -> int:
    """Label rows in a labels file (0 when there is none)."""
    return len({r["id"] for r in D.read_jsonl(path, labelled=True, scale=D.EXPERT)}) if os.path.isfile(path) else 0


def _children(parents: list[str], step: str) -> list:
    """Runs of `step` under any of `parents`, newest first."""
    out = []
    for parent in parents:
        frame = T.search_runs(f"tags.mlflow.parentRunId = '{parent}' and tags.rlhf.step = '{step}'")
        out += [row for _, row in frame.iterrows()] if len(frame) else []
    return sorted(out, key=lambda row: row["start_time"], reverse=True)


def _versions_of(run_id: str, name: str) -> list:
    return REG.client().search_model_versions(f"name = '{name}' and run_id = '{run_id}'")


def train_or_reuse(jobs: list[TrainJob], world: WorldPaths, parent_run_id: str, state: MainState,
                   echo: Callable[[str], None], on_done: Callable[[str, dict], None]) -> dict[str, dict]:
    """train_all, except for candidates an earlier main run of this --out trained (their registered
    version) or started (continued from its newest complete checkpoint in the same run)."""
    earlier = {}
    rounds = [row["run_id"] for row in _children(state.earlier, "round")]  # a later round's candidates are its
    for row in _children(state.earlier + rounds, "train_rl"):  # newest first: the first of a name wins
        earlier.setdefault(row["tags.mlflow.runName"], row)
    reused, todo = {}, []
    for job in jobs:
        row = earlier.get(job.name)
        versions = _versions_of(row["run_id"], REG.REGISTERED_MODEL) if row is not None else []
        if versions:
            reused[job.name] = {"run_id": row["run_id"], "model_version": str(versions[0].version), "reused": True}
        elif row is not None and row["status"] in ("KILLED", "FAILED"):
            todo.append(replace(job, resume_run_id=row["run_id"]))
        else:
            todo.append(job)
    for name, s in reused.items():
        echo(f"train_rl {name}: version {s['model_version']} from run {s['run_id']} (trained before the resume)")
        on_done(name, s)
    done = train_all(todo, world, parent_run_id, echo, on_done=on_done) if todo else {}
    return {job.name: reused.get(job.name) or done[job.name] for job in jobs}


def reused_repair(state: MainState, r: int, rm_dir: str) -> dict | None:
    """run_repair_rm's result for round r when an earlier main run of this --out finished it: the
    round's repair_rm run registered a version holding exactly rm_dir's files, and the gate decided."""
    if not state.earlier or not os.path.isdir(rm_dir):
        return None
    rounds = [row["run_id"] for row in _children(state.earlier, "round") if row["tags.mlflow.runName"] == f"round-{r}"]
    for row in _children(rounds, "repair_rm"):
        for mv in _versions_of(row["run_id"], RMR.RM_MODEL):
            decided = mv.tags.get("gate.decision")
            if decided and RMR.recorded_sha256(mv) == content_sha256(rm_dir):
                return _repair_result(row, mv, decided == "promoted", rm_dir)
    return None


def _repair_result(row, mv, promoted: bool, rm_dir: str) -> dict | None:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        paths = [T.download_artifact(row["run_id"], name, tmp) for name in ("repair.json", "diagnostic_repaired.json")]
        if None in paths:
            return None
        info, diagnostic = (_read(p) for p in paths)
    return {"version": str(mv.version), "parent_version": mv.tags.get("parent_version"), "promoted": promoted,
            "agreement": info["agreement"], "diagnostic": diagnostic, "out": rm_dir, "run_id": row["run_id"],
            "reused": True}


def _read(path: str):
    with open(path) as f:
        return json.load(f)


def release_and_grade(versions: list[str], world: WorldPaths, guardrails: dict | None, state: MainState,
                      echo: Callable[[str], None]) -> None:
    """Release each version in order (one not decided yet), then grade each (one not graded yet)."""
    for v in versions:
        decision = REG.get_version(v).tags.get("release.decision", "")
        if decision.startswith(DECIDED):
            echo(f"release version {v}: {decision} before the resume")
        else:
            run_release(v, guardrails=guardrails, echo=echo)
    for v in versions:
        if not state.done.get(f"graded/v{v}"):
            run_grade(v, world, echo=lambda m: None)
            state.mark(f"graded/v{v}")
