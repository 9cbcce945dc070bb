"""Which expert set chose a version's checkpoint, and so cannot certify it (the winner's curse).

A train_rl run with the over-optimisation watch estimates its policy's true quality from an expert set
every few steps; `select="watch_best"` / `"watch_proposal"` (main's corrected candidates) or
`early_stop=stop` registers the checkpoint with the best of those estimates. The best of many noisy
estimates is too high by the choice, so the same expert set is no evidence of that checkpoint's value:
certify then certifies it from labels on its own fresh samples only (CertifyConfig.chosen_on_expert_set),
and release refuses a certification that reused the expert set. Read from the training run's parameters,
which cannot change once logged (a run from before `select` was one: its tag `rlhf.select`)."""
from __future__ import annotations

import os
from dataclasses import replace

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import tables as TB
from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.decisions import certify as C
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T


WATCH_SELECT = ("watch_best", "watch_proposal")
"""`select` by the watch: its best point where the expert set vouches for every family, or its proposal
(the best estimate, vouched for or not: for a caller that buys labels to vouch for it, as `main` does)."""


def select_param(select, early_stop: str) -> str:
    """How the registered checkpoint is chosen, as the train_rl run's parameter `select` (a parameter
    cannot change once logged: certify and release read it to know whether the watch's expert set chose
    it): a WATCH_SELECT name (early_stop=stop registers the watch's best), "final", or "caller" (a
    function of the caller's)."""
    if select is None and early_stop == "stop":
        return "watch_best"
    return select if select in WATCH_SELECT else "final" if select is None else "caller"


def chosen_on(version: str | None) -> dict | None:
    """How the version's checkpoint was chosen by an expert set: {"by", "train_run", "expert_set_sha256",
    "expert_set" (its path as the run logged it)}, or None (registered as trained, by the caller's own
    rule, or not by a train_rl run). InputError when the version names a training run the store no longer
    has: how it was chosen cannot be known."""
    if not version:
        return None
    mv = REG.get_version(version)
    if not mv.run_id:
        return None
    try:
        run = T.get_run(mv.run_id)
    except InputError:
        raise InputError(f"version {version}: its run {mv.run_id} is not in the store, so how its checkpoint was "
                         "chosen (on which expert set) cannot be known: register it again") from None
    param = lambda key: T.logged_param(run.data.params, key)  # noqa: E731  (under `mlflow run`: resolved.<key>)
    sha = param("watch_gold_sha256")
    if run.data.tags.get("rlhf.step") != "train_rl" or not sha or not _watched(param("watch_every")):
        return None
    select = param("select") or run.data.tags.get("rlhf.select")
    if select in WATCH_SELECT or param("early_stop") == "stop":
        by = select if select in WATCH_SELECT else "early_stop=stop"
        return {"by": f"the watch ({by})", "train_run": mv.run_id, "expert_set_sha256": sha,
                "expert_set": param("watch_gold")}
    return None


def _watched(every) -> bool:
    """Whether a run's watch_every parameter says the watch ran (one that is not a number: it may have)."""
    try:
        return float(every or 0) > 0
    except ValueError:
        return True


def for_expert_set(cfg: C.CertifyConfig, version: str | None, expert_path: str | None, table: bool = False
                   ) -> tuple[C.CertifyConfig, dict | None]:
    """`cfg` for certifying `version` on the expert set at `expert_path` (a seed-format file, or with
    `table` an expert-set table): with chosen_on_expert_set when it holds an answer of the expert set that
    chose the version's checkpoint; and what the report says of the choice (None: no expert set chose it)."""
    chosen = chosen_on(version)
    if chosen is None or expert_path is None or not reuses(chosen, expert_path, table):
        return cfg, None
    return replace(cfg, chosen_on_expert_set=True), chosen


def reuses(chosen: dict, expert_path: str, table: bool = False) -> bool:
    """Whether the expert set at `expert_path` shares an answer (family, prompt, response) with the one
    that chose the checkpoint: the same content, or the same rows in another file (reordered, a table with
    scores beside them, relabelled). True also when that cannot be checked (the choosing file is gone or
    changed, this one unreadable here): the expert set is then not counted."""
    if os.path.isfile(expert_path) and content_sha256(expert_path) == chosen["expert_set_sha256"]:
        return True
    watch = chosen.get("expert_set")
    if not (watch and os.path.isfile(watch) and os.path.isfile(expert_path)
            and content_sha256(watch) == chosen["expert_set_sha256"]):
        return True
    return bool(_answers(watch, False) & _answers(expert_path, table))


def _answers(path: str, table: bool) -> set[tuple]:
    """(family, prompt, response tokens) of every row of an expert set."""
    if not table:
        return {(r["family"], tuple(r["attrs"]), tuple(r["response"]))
                for r in D.read_jsonl(path, labelled=True, scale=D.EXPERT)}
    return {(r["family"], tuple(r["seed"]["attrs"]) if r["seed"] else r["prompt_text"],
             tuple(r["seed"]["response"]) if r["seed"] else tuple(str(r["response"]).split()))
            for r in TB.read_expert_set(path)}


def reuse_problem(report: dict, version) -> str | None:
    """Why a certification reused the expert set that chose the version's checkpoint (release's check,
    from the store and the expert set itself, whatever the report says of itself), or None."""
    chosen = chosen_on(version.version)
    inputs = report.get("inputs", {})
    table = report.get("kind") == "table"
    path = inputs.get("expert_set") if table else inputs.get("gold")
    if chosen is None or not path or not reuses(chosen, path, table):
        return None
    reused = [f for f, r in report.get("families", {}).items() if (r.get("evidence_weights") or {}).get("expert_set")]
    if reused or not report.get("config", {}).get("chosen_on_expert_set"):
        return (f"its checkpoint was chosen on that expert set's estimates by {chosen['by']} (training run "
                f"{chosen['train_run']}), and the certification counts the expert set as evidence of it (the "
                "winner's curse" + (f": {', '.join(reused)}" if reused else "") + "): certify it again, from "
                "labels on its own samples")
    return None
