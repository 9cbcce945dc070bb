"""The one output rule (issue 45): every command that writes a directory (build-world, train-rl, train-rm,
repair-rm and its portable form, main) writes only into a new or empty directory, into its own run's (a
resume; for build-world the world asked for), or with --overwrite into another run's of the same
command, as the marker says (.rlhf_run.json; main's main_state.json; a world's manifest.json). Files no
marker claims, a world, the tracking store and another command's directory are refused in one line
before any run, with the store, the registry and every file as they were (sweep's --out is a file:
it never takes a directory)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from rlhf_mlflow.core import files
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import WorldPaths
from test_output_paths import _fails, _ok, _refused_leaving_all, _run, _store, _tree

TINY = ["--steps", 2, "--log-every", 1, "--batch-prompts", 4, "--samples-per-prompt", 2]


def _labels(world: str, tmp_path) -> str:
    """Expert labels on the reference policy's own responses (the synthetic expert), two per family."""
    from rlhf_mlflow.evidence.label_requests import draw_requests
    from rlhf_mlflow.world.annotator import label_requests
    paths = WorldPaths.at(world)
    requests = draw_requests(M.load_policy(paths.policy)[0], D.read_jsonl(paths.expert_set, labelled=True), 2)
    out = str(tmp_path / "labels.jsonl")
    D.write_jsonl(out, label_requests(paths, requests))
    return out


COMMANDS = {
    "build-world": lambda w, t: ["build-world", "--scale", "test"],
    "train-rl": lambda w, t: ["train-rl", "--world", w, *TINY, "--no-register"],
    "train-rm": lambda w, t: ["train-rm", "--data", f"{w}/reward_model/train.jsonl", "--epochs", 1],
    "repair-rm": lambda w, t: ["repair-rm", "--world", w, "--labels", _labels(w, t), "--epochs", 1,
                               "--label-head", "off"],
    "main": lambda w, t: ["main", "--world", w, "--steps-scale", 0.01, "--rounds", 1],
    "sweep": lambda w, t: ["sweep", "--world", w, *TINY, "--grid", "kl_coef=0.1"],
}
STEP = {"build-world": "build_world", "train-rl": "train_rl", "train-rm": "train_rm", "repair-rm": "repair_rm",
        "main": "main"}
DIRECTORY_COMMANDS = list(STEP)


def _args(command, tiny_world, tmp_path, out, *extra) -> list:
    return [*COMMANDS[command](tiny_world, tmp_path), "--out", out, *extra]


def _notes(tmp_path, name="mine"):
    out = tmp_path / name
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    return out


def _marked(tmp_path, command: str, run_id: str = "abc", name="theirs"):
    """A directory a `command` run `run_id` wrote: its marker and one file of its own."""
    out = tmp_path / name
    if command == "main":
        from rlhf_mlflow.steps.main import resume as MR
        out.mkdir()
        MR.MainState(str(out / MR.STATE), {"world_hash": "0123456789abcdef"}, [run_id], finished=True).save()
    else:
        files.claim_out_dir(str(out), files.Owner(command, run_id))
    (out / "result.json").write_text("{}")
    return out


# refused, whatever the command ----------------------------------------------------------------------

@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_directory_no_run_marked_is_refused_and_left_as_it_was(tiny_world, tmp_path, command):
    """The measured loss: `repair-rm --out DIR` replaced any directory (notes.txt gone, rc 0)."""
    out = _notes(tmp_path)
    needle = "is a directory; expected a file path" if command == "sweep" else "files that no run marked as its own"
    extras = [[]] if command == "sweep" else [[], ["--overwrite"]]
    for extra in extras:
        _refused_leaving_all(tmp_path, _args(command, tiny_world, tmp_path, out, *extra), f"--out {out}", needle)
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_world_is_refused_and_left_whole(tiny_world, tmp_path, command):
    world = tmp_path / "world"
    shutil.copytree(tiny_world, world)
    if command == "build-world":  # a world in the seed's layout no builder here wrote (no manifest.json)
        os.remove(world / "manifest.json")
        needle = "files that no run marked as its own"
    else:
        needle = f"is the world {world}"
    _refused_leaving_all(tmp_path, _args(command, tiny_world, tmp_path, world), needle)
    if command in ("train-rl", "train-rm", "repair-rm", "main"):
        _refused_leaving_all(tmp_path, _args(command, tiny_world, tmp_path, world / "data" / "new"), "lies inside the world")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_tracking_store_is_refused(tiny_world, tmp_path, command):
    import mlflow
    client = mlflow.MlflowClient()  # a store with a run and an artifact (no fluent state: an earlier test's lingers)
    run = client.create_run(client.create_experiment("kept"))
    client.log_text(run.info.run_id, "kept", "kept.txt")
    client.set_terminated(run.info.run_id)
    assert os.path.isdir(tmp_path / "mlruns")  # the sqlite store's artifact root, beside its database
    _refused_leaving_all(tmp_path, _args(command, tiny_world, tmp_path, "mlruns"),
                         "--out mlruns: is the tracking store's artifact root")
    _refused_leaving_all(tmp_path, _args(command, tiny_world, tmp_path, "."), "--out .: contains")  # (or an input)


@pytest.mark.parametrize("command", DIRECTORY_COMMANDS)
def test_another_commands_directory_is_refused_even_with_overwrite(tiny_world, tmp_path, command):
    other = "repair_rm" if command == "train-rm" else "train_rm"
    out = _marked(tmp_path, other)
    for extra in ([], ["--overwrite"]):
        _refused_leaving_all(tmp_path, _args(command, tiny_world, tmp_path, out, *extra),
                             f"the files of {other} run abc, not a {STEP[command]} run's")


@pytest.mark.parametrize("command", DIRECTORY_COMMANDS)
def test_another_run_of_the_same_command_is_refused_without_overwrite(tiny_world, tmp_path, command):
    if command == "build-world":  # another world this builder wrote: seed 0's, asked for seed 1's
        out = tmp_path / "world"
        shutil.copytree(tiny_world, out)
        args = _args(command, tiny_world, tmp_path, out, "--seed", 1)
        needle = f"already holds world {json.loads((out / 'manifest.json').read_text())['world_hash']}, not the one"
    else:
        out = _marked(tmp_path, STEP[command])
        args = _args(command, tiny_world, tmp_path, out)
        needle = f"already holds the files of {STEP[command]} run abc"
    line = _refused_leaving_all(tmp_path, args, f"--out {out}", needle)
    assert "--overwrite" in line


def test_overwrite_never_deletes_a_store_or_the_current_directory(tiny_world, tmp_path, monkeypatch):
    out = _marked(tmp_path, "train_rl")
    (out / "old.db").write_bytes(b"SQLite format 3\0" + bytes(84))  # a tracking store someone kept in it
    _refused_leaving_all(tmp_path, _args("train-rl", tiny_world, tmp_path, out, "--overwrite"),
                         "--overwrite would delete the tracking store", "old.db")
    os.remove(out / "old.db")
    (out / "sub").mkdir()
    monkeypatch.chdir(out / "sub")
    with pytest.raises(InputError, match="would delete the current directory"):
        files.check_out_dir(str(out), "train_rl", overwrite=True)


# accepted: new, own, or another run's with --overwrite --------------------------------------------------

def test_build_world_reuses_its_world_and_replaces_another_only_with_overwrite(tiny_world, tmp_path):
    world = tmp_path / "world"
    shutil.copytree(tiny_world, world)
    before = _tree(world)
    same = _ok(_run(*_args("build-world", tiny_world, tmp_path, world)))  # the world asked for: its own
    assert _tree(world) == before and files.owner_of(str(world)) == files.Owner("build_world", same["world_hash"])
    other = _ok(_run(*_args("build-world", tiny_world, tmp_path, world, "--seed", 1, "--overwrite")))
    assert other["world_hash"] != same["world_hash"]
    assert files.owner_of(str(world)) == files.Owner("build_world", other["world_hash"])
    assert not (world / files.RUN_MARKER).exists()  # a world's marker is its manifest: nothing unlisted in it
    assert [r[1] for r in _store()["runs"]] == ["FINISHED", "FINISHED"]


@pytest.mark.parametrize("command", ["train-rl", "train-rm"])
def test_a_rerun_into_its_own_output_needs_overwrite(tiny_world, tmp_path, command):
    """Run 1 into a new directory marks it; the same command again is refused (nothing written, no run);
    with --overwrite it replaces it and the marker names run 2."""
    out = tmp_path / "out"
    first = _ok(_run(*_args(command, tiny_world, tmp_path, out)))
    marker = json.loads((out / files.RUN_MARKER).read_text())
    assert marker["command"] == STEP[command] and len(marker["run_id"]) == 32
    if command == "train-rl":
        assert marker["run_id"] == first["run_id"]
        assert files.check_out_dir(str(out), "train_rl", run_id=first["run_id"]) == str(out)  # its resume
    _refused_leaving_all(tmp_path, _args(command, tiny_world, tmp_path, out), f"the files of {STEP[command]} run")
    (out / "stale.txt").write_text("from run 1")
    _ok(_run(*_args(command, tiny_world, tmp_path, out, "--overwrite")))
    second = json.loads((out / files.RUN_MARKER).read_text())
    assert second["command"] == STEP[command] and second["run_id"] != marker["run_id"]
    assert not (out / "stale.txt").exists() and not [n for n in os.listdir(tmp_path) if ".old-" in n or ".tmp-" in n]


# a real repair (cross-validation, then the diagnostic on the repaired model): ~90 s on a busy machine; the
# portable repair below shows the same rule where the directory is written, in seconds
@pytest.mark.slow
def test_repair_rm_replaces_another_repairs_directory_only_with_overwrite(tiny_world, tmp_path):
    import mlflow

    from rlhf_mlflow.tracking import rm_registry as RMR
    out = _marked(tmp_path, "repair_rm")
    args = _args("repair-rm", tiny_world, tmp_path, out)
    _refused_leaving_all(tmp_path, args, "the files of repair_rm run abc", "--overwrite")
    result = _ok(_run(*args, "--overwrite"))
    marker = json.loads((out / files.RUN_MARKER).read_text())
    assert marker == {"command": "repair_rm", "run_id": result["run_id"]} and not (out / "result.json").exists()
    assert (out / "rm.safetensors").is_file() and (out / "repair.json").is_file()
    assert len(mlflow.MlflowClient().search_model_versions(f"name = '{RMR.RM_MODEL}'")) == 2  # root and repair
    _refused_leaving_all(tmp_path, args, f"the files of repair_rm run {result['run_id']}")  # a rerun: --overwrite


def test_main_resumes_its_own_directory_and_starts_over_a_finished_one_only_with_overwrite(tiny_world, tmp_path):
    from rlhf_mlflow.steps.main import resume as MR
    out = tmp_path / "out"
    os.makedirs(out)
    stopped = MR.MainState(str(out / MR.STATE), MR.settings(WorldPaths.at(tiny_world), 0.05, 1200, 2, {}), ["abc"])
    stopped.save()
    assert files.owner_of(str(out)) == files.Owner("main", "abc")
    target, state = MR.check_out(str(out), None, resume=True, overwrite=False)  # its own: a resume
    assert target == str(out) and state.runs == ["abc"]
    for extra, needle in ((["--overwrite"], "did not finish (run abc)"), (["--resume", "--overwrite"], "one of them")):
        res = _run(*_args("main", tiny_world, tmp_path, out, *extra))
        assert res.exit_code == 2 and needle in res.output, res.output
    stopped.finished = True
    stopped.save()
    (out / "labels-v1.jsonl").write_text("")
    _refused_leaving_all(tmp_path, _args("main", tiny_world, tmp_path, out), "the files of main run abc", "--overwrite")
    MR.check_out(str(out), None, resume=False, overwrite=True)
    state = MR.begin(str(out), stopped.settings, False, lambda m: None, overwrite=True)  # what main --overwrite does
    assert os.listdir(out) == [MR.STATE] and state.runs == [] and not state.finished


# the portable repair: the same rule, its own error convention (exit 2, `error:`) -------------------------

def test_the_portable_repair_follows_the_rule(tiny_world, tmp_path, capsys):
    from rlhf_mlflow.cli.portable import repair_main
    world = WorldPaths.at(tiny_world)
    labels = _labels(tiny_world, tmp_path)
    base = ["--rm-dir", world.reward_model, "--qa", world.qa, "--labels", labels, "--epochs", "1", "--label-head", "off"]
    copy = tmp_path / "world"
    shutil.copytree(tiny_world, copy)
    cases = [(_notes(tmp_path), [], "no run marked"), (copy, [], "is the world"),
             (_marked(tmp_path, "train_rl", name="rl"), ["--overwrite"], "not a repair_rm run's"),
             (_marked(tmp_path, "repair_rm", run_id=None), [], "pass --overwrite")]
    before = _tree(tmp_path)
    for out, extra, needle in cases:
        assert repair_main([*base, "--out", str(out), *extra]) == 2
        assert needle in capsys.readouterr().err
    assert _tree(tmp_path) == before and _store() is None
    out = tmp_path / "theirs"  # another portable repair's: replaced with --overwrite, marked as a repair's again
    assert repair_main([*base, "--out", str(out), "--overwrite"]) == 0
    assert files.owner_of(str(out)) == files.Owner("repair_rm", None) and (out / "rm.safetensors").is_file()
    assert not (out / "result.json").exists()


# the rule itself: checked again where the directory is written -------------------------------------------

def test_a_directory_that_changed_after_the_check_is_not_replaced(tmp_path):
    out = tmp_path / "rm"
    with pytest.raises(InputError, match="not replacing them"):
        with files.atomic_dir(str(out), files.Owner("train_rm", "r2")) as staging:
            open(os.path.join(staging, "rm.safetensors"), "w").close()
            _notes(tmp_path, "rm")  # the user's files appear while the run writes
    assert os.listdir(out) == ["notes.txt"] and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    with pytest.raises(InputError, match="not deleting them"):
        files.claim_out_dir(str(out), files.Owner("train_rl", "r2"), overwrite=True)
    assert os.listdir(out) == ["notes.txt"]


def test_markers_name_command_and_run_and_old_train_rl_markers_still_count(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / files.RUN_MARKER).write_text(json.dumps({"run_id": "abc"}))  # written before markers named commands
    assert files.owner_of(str(out)) == files.Owner("train_rl", "abc")
    (out / files.RUN_MARKER).write_text("[" * 100000)  # unreadable: no marker, so nothing may replace it
    assert files.owner_of(str(out)) is None
    with pytest.raises(InputError, match="no run marked"):
        files.check_out_dir(str(out), "train_rl", overwrite=True)
