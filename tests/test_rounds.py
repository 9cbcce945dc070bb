"""`main --rounds`: a later round repairs the reward model with every label so far and trains, certifies,
releases and grades the corrected recipes on it, all as nested runs of main's (issue 30)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import mlflow
import pytest

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.main.labels import (decided, futile, note_purchase, open_thresholds, predicted_balanced,
                                           purchase_metrics, purchases, purchases_markdown, stop_reason)
from rlhf_mlflow.steps.main.rounds import labels_so_far, recipe_of, round_of
from rlhf_mlflow.tracking import rm_registry as RMR


def test_a_candidate_name_gives_back_its_recipe_and_round():
    assert recipe_of("r2-corrected-kl005-s1200") == "corrected-kl005-s1200"
    assert recipe_of("corrected-s800") == "corrected-s800" and recipe_of("rx-a") == "rx-a"
    assert [round_of(n) for n in ("r2-corrected-s800", "r12-x", "corrected-s800", "rx-a")] == [2, 12, 1, 1]


def test_the_label_ledger_says_what_each_purchase_bought_for_what(tmp_path):
    """Each purchase once (a look bought again after a resume replaces its row), per family, per purpose."""
    row = {"family": "anvil", "attrs": [0, 1, 2, 3], "response": ["ba"] * 8, "label": 0.5}
    certify = str(tmp_path / "labels-v1.jsonl")
    D.write_jsonl(certify, [{**row, "id": f"c{i}"} for i in range(3)])
    note_purchase(str(tmp_path), "certify", 1, "1", certify)
    D.write_jsonl(certify, [{**row, "id": f"c{i}", "family": f} for i, f in enumerate(["anvil", "birch"] * 3)])
    note_purchase(str(tmp_path), "certify", 1, "1", certify)   # the next look: the same purchase, grown
    repair = str(tmp_path / "labels-r2-v1.jsonl")
    D.write_jsonl(repair, [{**row, "id": f"r{i}", "family": "dune"} for i in range(4)])
    note_purchase(str(tmp_path), "repair", 2, "1", repair)
    rows = purchases(str(tmp_path))
    assert [(r["purpose"], r["round"], r["labels"]) for r in rows] == [("certify", 1, 6), ("repair", 2, 4)]
    assert rows[0]["families"] == {"anvil": 3, "birch": 3} and purchase_metrics(rows) == {
        "expert_labels/certify": 6.0, "expert_labels/repair": 4.0}
    text = purchases_markdown(rows)
    assert "| 2 | repair | v1 | 0 | 0 | 4 | 4 |" in text and "In all 10 (certify 6, repair 4)" in text


def _gains(balanced: tuple, family: tuple) -> dict:
    row = lambda g: {"certifiable": True, "gain": g[0], "gain_lo": g[1], "gain_hi": g[2]}  # noqa: E731
    return {"balanced": row(balanced), "families": {f: row(family) for f in ("anvil", "birch")}}


def test_labels_stop_once_decided_or_once_the_last_round_could_not_decide_either():
    clear = _gains((0.2, 0.1, 0.3), (0.1, 0.0, 0.2))                 # every threshold outside: decided
    assert decided(clear) and not futile(clear, 20, 50)
    close = _gains((0.2, 0.1, 0.3), (-0.025, -0.08, 0.03))           # -0.03 inside, 0.005 from the estimate
    assert not decided(close) and futile(close, 20, 50)             # 50 labels: +-0.035 still holds it
    far = _gains((0.2, 0.1, 0.3), (0.02, -0.035, 0.075))             # 0.05 from it: 50 labels would decide
    assert not decided(far) and not futile(far, 20, 50)
    assert open_thresholds({**clear, "balanced": {"certifiable": False}}) is None   # more labels may certify it
    assert [stop_reason(r, 20) for r in (clear, close, far)] == ["decided", "futile", None]
    assert stop_reason(close, 50) is None and stop_reason(clear, 50) == "decided"   # the last round: no futility


def test_a_candidate_is_screened_by_its_predicted_balanced_quality():
    fams = {"anvil": {"estimate": 0.6, "doubly_robust": 0.1}, "birch": {"estimate": None, "doubly_robust": 0.4},
            "cobalt": {"estimate": None, "doubly_robust": None, "direct": 0.2}}
    report = {"families": fams, "balanced": {"weights": {"anvil": 0.5, "birch": 0.25, "cobalt": 0.25}}}
    assert predicted_balanced(report) == pytest.approx(0.5 * 0.6 + 0.25 * 0.4 + 0.25 * 0.2)
    fams["cobalt"]["direct"] = None
    assert predicted_balanced(report) is None   # nothing to go on: never a reason to skip


def test_labels_so_far_counts_each_request_once(tmp_path):
    row = {"id": "req-v1-anvil-000", "family": "anvil", "attrs": [0, 1, 2, 3], "response": ["ba"] * 8, "label": 0.5}
    D.write_jsonl(str(tmp_path / "labels-v1.jsonl"), [row])
    D.write_jsonl(str(tmp_path / "labels-r2-v1.jsonl"), [row, {**row, "id": "req-v1-anvil-001"}])
    D.write_jsonl(str(tmp_path / "label_requests-v1.jsonl"), [{k: v for k, v in row.items() if k != "label"}])
    assert [r["id"] for r in labels_so_far(str(tmp_path))] == ["req-v1-anvil-000", "req-v1-anvil-001"]


@pytest.mark.slow
def test_a_second_round_repairs_the_reward_model_and_trains_certifies_and_releases_on_it(tiny_world, tmp_path):
    from rlhf_mlflow.steps.main.run import run_main
    out = str(tmp_path / "out")
    table = run_main(WorldPaths.at(tiny_world), out, steps_scale=0.05, ceiling=False, echo=lambda m: None,
                     label_budget=1200, rounds=2)
    records = table.attrs["rounds"]
    assert [r["round"] for r in records] == [2]
    rec = records[0]
    assert json.load(open(os.path.join(out, "rounds.json")))[0]["rm_version"] == rec["rm_version"]
    runs = mlflow.search_runs(search_all_experiments=True)
    main_id = runs.loc[runs["tags.rlhf.step"] == "main", "run_id"].iloc[0]
    round_run = runs[runs["tags.rlhf.step"] == "round"].iloc[0]
    assert round_run["tags.mlflow.parentRunId"] == main_id
    repair = runs[runs["tags.rlhf.step"] == "repair_rm"].iloc[0]
    assert repair["tags.mlflow.parentRunId"] == round_run["run_id"]
    mv = mlflow.MlflowClient().get_model_version(RMR.RM_MODEL, rec["rm_version"])
    assert mv.tags["parent_version"] != "none" and int(mv.tags["expert_labels"]) > rec["repair_labels"]
    assert rec["labels_spent"] <= 1200
    if not rec["rm_promoted"]:
        assert mv.description.startswith("REFUSED")
        return
    # the round's candidates were trained on the repaired model, then certified, released and graded
    assert len(rec["versions"]) == 2
    later = table[table["candidate"].str.startswith("r2-")]
    assert sorted(later["model_version"]) == sorted(rec["versions"])
    assert later["decision"].notna().all() and later["truth_balanced"].notna().all()
    trained = runs[runs["tags.rlhf.round"] == "2"]
    assert len(trained) == 2 and all(p.endswith("reward_model_r2") for p in trained["params.reward_model"])


RLHF_MLFLOW = os.path.join(os.path.dirname(sys.executable), "rlhf-mlflow")


def _stopped_main(tiny_world, out, **changed) -> None:
    """An --out holding the state of a main that stopped (run `abc`), with the given settings changed."""
    from rlhf_mlflow.steps.main import resume as MR
    os.makedirs(out)
    settings = MR.settings(WorldPaths.at(tiny_world), 0.05, 1200, 2, {}) | changed
    MR.MainState(os.path.join(out, MR.STATE), settings, ["abc"]).save()


@pytest.mark.parametrize("args,message", [
    (["--rounds", "3"], "--rounds 3: the stopped main ran with 2"),
    (["--label-budget", "600"], "--label-budget 600: the stopped main ran with 1200"),
    (["--steps-scale", "0.1"], "--steps-scale 0.1: the stopped main ran with 0.05"),
    (["--guardrail", "max_family_kl=4"], "--guardrail"),
])
def test_a_resume_with_other_settings_is_refused_naming_the_option(tiny_world, tmp_path, args, message):
    from click.testing import CliRunner

    from rlhf_mlflow.cli import cli
    out = str(tmp_path / "out")
    _stopped_main(tiny_world, out)
    res = CliRunner().invoke(cli, ["main", "--world", tiny_world, "--out", out, "--resume", *args])
    assert res.exit_code == 2 and message in res.output, res.output
    assert not mlflow.search_runs(search_all_experiments=True, output_format="list")


def test_a_resume_on_another_world_or_without_a_stopped_main_is_refused(tiny_world, tmp_path):
    from click.testing import CliRunner

    from rlhf_mlflow.cli import cli
    out = str(tmp_path / "out")
    res = CliRunner().invoke(cli, ["main", "--world", tiny_world, "--out", out, "--resume"])
    assert res.exit_code == 2 and "holds no main to resume" in res.output, res.output
    _stopped_main(tiny_world, out, world_hash="0123456789abcdef")
    res = CliRunner().invoke(cli, ["main", "--world", tiny_world, "--out", out, "--resume", "true"])
    assert res.exit_code == 2 and "--world" in res.output and "0123456789abcdef" in res.output, res.output
    # without --resume, a main that did not finish is not started over (its labels would be bought again)
    res = CliRunner().invoke(cli, ["main", "--world", tiny_world, "--out", out])
    assert res.exit_code == 2 and "did not finish (run abc)" in res.output and "--resume" in res.output, res.output
    assert not mlflow.search_runs(search_all_experiments=True, output_format="list")


def _main(args: list[str], cwd, log) -> subprocess.Popen:
    # its own process group: a failing test takes main's training workers down with it
    return subprocess.Popen([RLHF_MLFLOW, "main", *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, log_path, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"main took over {timeout} s:\n{open(log_path).read()[-3000:]}")


def _kill_when_round_2_trains(proc: subprocess.Popen, log_path, timeout: float = 1500) -> None:
    """SIGTERM once a round-2 candidate has a checkpoint in the store (its repair is registered and decided)."""
    client, deadline = mlflow.MlflowClient(), time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.rlhf.round = '2'",
                                  output_format="list")
        if any(client.list_artifacts(r.info.run_id, "checkpoints") for r in runs):
            proc.send_signal(signal.SIGTERM)
            assert _finish(proc, log_path, 120) == 130
            return
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"main never trained a round-2 candidate:\n{open(log_path).read()[-3000:]}")


def _labelled_before(out: str) -> dict[str, str]:
    """{label requests file: its labels file} for every labels file in --out (each request file's labels)."""
    found = {}
    for name in os.listdir(out):
        m = re.fullmatch(r"labels-(r\d+)?-?(v\d+)\.jsonl", name)
        if m:
            found[f"label_requests-{m.group(1)}-new.jsonl" if m.group(1) else f"label_requests-{m.group(2)}.jsonl"] = name
    return found


@pytest.mark.slow
def test_a_main_killed_in_round_2_resumes_without_buying_its_labels_again(tiny_world, tmp_path):
    """`main --rounds 2` gets SIGTERM while round 2's candidates train; `main --resume` finishes it: the
    labels bought before are not bought again and count once, round 1 and the repair are not run again,
    the killed runs are KILLED, every version has one release decision, the summary has both rounds."""
    out, log = str(tmp_path / "out"), str(tmp_path / "main.log")
    args = ["--world", tiny_world, "--steps-scale", "0.05", "--rounds", "2", "--label-budget", "1200", "--out", out]
    runs = lambda: mlflow.search_runs(search_all_experiments=True, output_format="list")  # noqa: E731
    runs()  # the store made here: the polling below and main must not both create its tables
    with open(log, "w") as f:
        _kill_when_round_2_trains(_main(args, tmp_path, f), log)
    killed_ids = {r.info.run_id for r in runs()}
    assert not [r for r in runs() if r.info.status == "RUNNING"]
    (killed,) = [r for r in runs() if r.data.tags["rlhf.step"] == "main"]
    assert killed.info.status == "KILLED"
    labelled = _labelled_before(out)
    held = {name: open(os.path.join(out, name)).read() for name in labelled.values()}
    assert any(name.startswith("labels-r2-") for name in held), held

    with open(log, "a") as f:
        assert _finish(_main(["--resume", "--out", out], tmp_path, f), log, 1500) == 0, open(log).read()[-3000:]
    after = runs()
    assert not [r for r in after if r.info.status == "RUNNING"]
    (resumed,) = [r for r in after if r.data.tags["rlhf.step"] == "main" and r.info.run_id not in killed_ids]
    assert resumed.data.tags["rlhf.resumes"] == killed.info.run_id and resumed.info.status == "FINISHED"
    new = [r for r in after if r.info.run_id not in killed_ids]
    # no label bought before the kill is asked for again; the budget counts every label once
    again = [r for r in new if r.data.tags["rlhf.step"] == "expert_label"
             and os.path.basename(r.data.params["requests"]) in labelled]
    assert not again and all(open(os.path.join(out, n)).read() == text for n, text in held.items())
    assert resumed.data.metrics["main/expert_labels"] == len(labels_so_far(out)) <= 1200
    # round 1, its diagnosis and round 2's repair are not run again; cut-short candidates continue their runs
    steps = [r.data.tags["rlhf.step"] for r in new]
    assert not {"diagnostic", "correction", "repair_rm"} & set(steps), steps
    names = [r.info.run_name for r in after if r.data.tags["rlhf.step"] == "train_rl"]
    assert len(names) == len(set(names)) and sum(n.startswith("r2-") for n in names) == 2, names
    # one release decision per version; the summary (the resumed main's) has both rounds
    client = mlflow.MlflowClient()
    for mv in client.search_model_versions("name = 'rlhf-policy'"):
        released = [r for r in after if r.data.tags["rlhf.step"] == "release" and r.info.status == "FINISHED"
                    and r.data.params["model_version"] == str(mv.version)]
        assert len(released) == 1 and mv.tags["release.decision"], (mv.version, len(released))
    assert all(mv.tags.get("gate.decision") for mv in client.search_model_versions("name = 'rlhf-reward-model'"))
    summary = client.download_artifacts(resumed.info.run_id, "summary.csv", str(tmp_path))
    candidates = open(summary).read()
    assert "corrected-" in candidates and "\nr2-corrected-" in candidates, candidates
    assert [r["round"] for r in json.load(open(os.path.join(out, "rounds.json")))] == [2]


def test_a_repair_is_reused_only_whole_registered_and_decided(tiny_world, tmp_path):
    """reused_repair trusts reward_model_r2 only when it holds exactly the files of a version that round 2's
    repair_rm run (under a main this one resumes) registered and the gate decided."""
    import shutil

    from rlhf_mlflow.steps.main import resume as MR
    from rlhf_mlflow.tracking import runs as T
    rm_dir = str(tmp_path / "out" / "reward_model_r2")
    shutil.copytree(os.path.join(tiny_world, "reward_model"), rm_dir)
    with T.tracked_run("main", run_name="main") as main, T.tracked_run("round", run_name="round-2"), \
            T.tracked_run("repair_rm", run_name="repair_rm-r2") as repair:
        T.log_artifact(rm_dir, RMR.ARTIFACT)
        T.log_json_artifact({"agreement": {"child": {"anvil": {"r": 0.5}}}}, "repair.json")
        T.log_json_artifact({"families": {}}, "diagnostic_repaired.json")
        version = RMR.register(repair.info.run_id, rm_dir, {"world_hash": "w", "parent_version": "none"})
    state = MR.MainState(str(tmp_path / "state.json"), {}, [main.info.run_id, "this-run"])
    assert MR.reused_repair(state, 2, rm_dir) is None  # registered, not decided: repaired again
    RMR.decide(version, {}, "production", None)
    reused = MR.reused_repair(state, 2, rm_dir)
    assert reused["version"] == version and reused["promoted"] and reused["agreement"]["child"]["anvil"]["r"] == 0.5
    assert MR.reused_repair(state, 3, rm_dir) is None  # another round's
    assert MR.reused_repair(MR.MainState(state.path, {}, ["this-run"]), 2, rm_dir) is None  # not a resume
    with open(os.path.join(rm_dir, "rm.safetensors"), "r+b") as f:  # files that are not the version's
        f.seek(-8, 2)
        f.write(b"\0" * 8)
    assert MR.reused_repair(state, 2, rm_dir) is None
