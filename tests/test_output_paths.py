"""No output path destroys a store, a world or an input (issue 28): every `--out` that is, holds or lies
inside the tracking store's files or a world, or that is or holds a file the command reads, is refused
in one line before any run starts, with the store, the registry and every file unchanged; --overwrite
deletes only a directory a run of this project marked as its own."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import mlflow
import pytest
from click.testing import CliRunner
from mlflow.entities import ViewType

from cli_checks import fails as _fails
from rlhf_mlflow.cli import cli
from rlhf_mlflow.core import files
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import WorldPaths

TINY = ["--steps", 2, "--log-every", 1, "--batch-prompts", 4, "--samples-per-prompt", 2]


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _ok(res) -> dict:
    assert res.exit_code == 0, res.output
    return json.JSONDecoder().raw_decode(res.output[res.output.index("{"):])[0]  # MLflow's own lines may follow


def _tree(root) -> dict[str, str]:
    """Every file under `root` (links not followed) and the sha256 of its bytes."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _store() -> dict | None:
    """What the store and the registry hold: experiments, runs (with status), models and versions; None
    while a sqlite store's database does not exist (asking would create it)."""
    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
        return None
    client = mlflow.MlflowClient()
    return {"experiments": sorted((e.experiment_id, e.name, e.lifecycle_stage)
                                  for e in client.search_experiments(view_type=ViewType.ALL)),
            "runs": sorted((r.info.run_id, r.info.status, r.data.tags.get("rlhf.step"))
                           for r in mlflow.search_runs(search_all_experiments=True, run_view_type=ViewType.ALL,
                                                       output_format="list")),
            "models": sorted((m.name, v.version, v.status) for m in client.search_registered_models()
                             for v in client.search_model_versions(f"name = '{m.name}'"))}


def _world(tiny_world, tmp_path, name="world"):
    dst = tmp_path / name
    shutil.copytree(tiny_world, dst)
    return dst


def _refused_leaving_all(tmp_path, args, *needles):
    """The command fails in one line, and the store, the registry and every file under tmp_path (the
    store's database and artifacts, the worlds, the inputs) are as they were."""
    before, files_before = _store(), _tree(tmp_path)
    line = _fails(_run(*args), *needles)
    assert _store() == before
    assert _tree(tmp_path) == files_before
    return line


# the tracking store ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sqlite", pytest.param("file", marks=pytest.mark.slow)])
def test_train_rl_out_mlruns_overwrite_from_the_store_directory_is_refused(tiny_world, tmp_path, monkeypatch, kind):
    """The measured disaster: from the store's directory, `--out mlruns --overwrite` deleted every run's
    artifacts. The artifact root (sqlite's ./mlruns, or a file store itself) and what is inside it are
    refused; the registered version's files and the store stay as they were."""
    if kind == "file":
        uri = (tmp_path / "mlruns").as_uri()
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores in maintenance mode
        mlflow.set_tracking_uri(uri)
    first = _ok(_run("train-rl", "--world", tiny_world, *TINY))  # registers version 1
    assert str(first["model_version"]) == "1" and os.path.isdir(tmp_path / "mlruns")
    what = "the tracking store's artifact root" if kind == "sqlite" else "the tracking store"
    _refused_leaving_all(tmp_path, ["train-rl", "--world", tiny_world, *TINY, "--out", "mlruns", "--overwrite"],
                         "--out mlruns: is", what)
    _refused_leaving_all(tmp_path, ["train-rl", "--world", tiny_world, *TINY, "--out", "mlruns/new"],
                         "lies inside")
    _refused_leaving_all(tmp_path, ["train-rl", "--world", tiny_world, *TINY, "--out", ".", "--overwrite"],
                         "--out .: contains")


def test_outs_onto_the_sqlite_database_or_a_symlink_to_the_store_are_refused(tiny_world, tmp_path):
    (tmp_path / "mlruns").mkdir()
    os.symlink(tmp_path / "mlruns", tmp_path / "alias")
    _refused_leaving_all(tmp_path, ["dev-eval", "--policy", f"{tiny_world}/policy", "--world", tiny_world,
                                    "--out", "mlflow.db"], "is the tracking store's database")
    _refused_leaving_all(tmp_path, ["train-rm", "--data", f"{tiny_world}/reward_model/train.jsonl",
                                    "--out", "alias/rm"], "--out alias/rm: lies inside the tracking store's")


# worlds and inputs ----------------------------------------------------------------------------------

def test_expert_label_out_onto_the_worlds_expert_set_is_refused(tiny_world, tmp_path):
    world = _world(tiny_world, tmp_path)
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"id": "r1", "family": "dune", "attrs": [0, 0, 0], "response": [1]}) + "\n")
    gold = world / "data" / "gold_calib.jsonl"
    _refused_leaving_all(tmp_path, ["expert-label", "--world", world, "--requests", requests, "--out", gold],
                         f"--out {gold}: lies inside the world {world}")
    from rlhf_mlflow.steps.expert_label import run_expert_label  # the step itself refuses too
    with pytest.raises(InputError, match="lies inside the world"):
        run_expert_label(WorldPaths.at(str(world)), str(requests), str(gold))
    assert _store() is None


def test_certify_out_onto_the_expert_set_it_reads_is_refused(tiny_world, tmp_path):
    world = _world(tiny_world, tmp_path)
    gold = world / "data" / "gold_calib.jsonl"
    _refused_leaving_all(tmp_path, ["certify", "--policy", world / "policy", "--world", world, "--out", gold],
                         "lies inside the world")
    loose = tmp_path / "gold.jsonl"  # an expert set outside any world: refused as an input
    shutil.copy(gold, loose)
    _refused_leaving_all(tmp_path, ["certify", "--policy", world / "policy", "--reference", world / "policy",
                                    "--gold", loose, "--out", loose], f"--out {loose}: is --gold", "reads")
    link = tmp_path / "link.jsonl"  # the same file by another name
    os.symlink(loose, link)
    _refused_leaving_all(tmp_path, ["certify", "--policy", world / "policy", "--reference", world / "policy",
                                    "--gold", loose, "--out", link], "is --gold")


@pytest.mark.parametrize("command", [
    ["bon", "--policy", "{w}/policy", "--reward-model", "{w}/reward_model", "--prompts", "{t}/p.jsonl",
     "--out", "{t}/p.jsonl"],
    ["diagnostic", "--rm-dir", "{w}/reward_model", "--policy-dir", "{w}/policy", "--prompts", "{t}/p.jsonl",
     "--out", "{t}/p.jsonl"],
    ["dev-eval", "--policy", "{w}/policy", "--policy-ref", "{w}/policy", "--reward-model", "{w}/reward_model",
     "--prompts", "{t}/p.jsonl", "--out", "{t}/p.jsonl"],
    ["correct", "--diagnostic", "{t}/p.jsonl", "--qa", "{w}/reward_model/train.jsonl", "--out", "{t}/p.jsonl"],
    ["train-rm", "--data", "{t}/in/p.jsonl", "--out", "{t}/in"],
])
def test_an_out_that_is_or_holds_an_input_is_refused(tiny_world, tmp_path, command):
    (tmp_path / "in").mkdir()
    shutil.copy(f"{tiny_world}/data/prompts_dev.jsonl", tmp_path / "p.jsonl")
    shutil.copy(f"{tiny_world}/data/prompts_dev.jsonl", tmp_path / "in" / "p.jsonl")
    args = [a.format(w=tiny_world, t=tmp_path) if isinstance(a, str) else a for a in command]
    _refused_leaving_all(tmp_path, args, "which this command reads")


@pytest.mark.parametrize("command", [
    ["bon", "--policy", "{w}/policy", "--reward-model", "{w}/reward_model", "--prompts",
     "{w}/data/prompts_dev.jsonl", "--out", "{w}/data/gold_calib.jsonl"],
    ["label-requests", "--model-version", "1", "--world", "{w}", "--out", "{w}/data/gold_calib.jsonl"],
    ["train-rm", "--data", "{w}/reward_model/train.jsonl", "--out", "{w}/policy"],
    ["train-rl", "--world", "{w}", "--out", "{w}/policy", "--overwrite"],
    ["main", "--world", "{w}", "--out", "{w}"],
])
def test_an_out_inside_a_world_is_refused(tiny_world, tmp_path, command):
    world = _world(tiny_world, tmp_path)
    args = [a.format(w=world) for a in command]
    _refused_leaving_all(tmp_path, args, f"the world {world}")


# --overwrite ----------------------------------------------------------------------------------------

def test_overwrite_refuses_a_directory_no_run_marked(tiny_world, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    line = _refused_leaving_all(tmp_path, ["train-rl", "--world", tiny_world, *TINY, "--out", out, "--overwrite"],
                                "files that no run marked as its own", files.RUN_MARKER)
    assert "--overwrite deletes only such a directory" in line
    with pytest.raises(InputError, match="no run marked"):
        files.check_out_dir(str(out), "train_rl", overwrite=True)
    with pytest.raises(InputError, match="not deleting"):
        files.claim_out_dir(str(out), files.Owner("train_rl", "abc"), overwrite=True)
    assert os.listdir(out) == ["notes.txt"]


def test_overwrite_refuses_a_marked_directory_that_holds_a_world(tiny_world, tmp_path):
    out = tmp_path / "run"
    files.claim_out_dir(str(out), files.Owner("train_rl", "old"))
    shutil.copytree(tiny_world, out / "nested")
    with pytest.raises(InputError, match="would delete the world"):
        files.check_out_dir(str(out), "train_rl", overwrite=True)
    files.claim_out_dir(str(tmp_path / "other"), files.Owner("train_rl", "old"))  # marked, world-free: deletable
    assert files.check_out_dir(str(tmp_path / "other"), "train_rl", overwrite=True) == str(tmp_path / "other")


# build-world ----------------------------------------------------------------------------------------

def test_build_world_refuses_an_existing_directory_it_did_not_write(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        _refused_leaving_all(tmp_path, ["build-world", "--scale", "test", "--out", out, *extra],
                             "files that no run marked as its own")
    run_dir = tmp_path / "run"  # a train-rl run's directory is no world either
    files.claim_out_dir(str(run_dir), files.Owner("train_rl", "abc"))
    _refused_leaving_all(tmp_path, ["build-world", "--scale", "test", "--out", run_dir, "--overwrite"],
                         "train_rl run abc, not a build_world run's")


def test_build_world_reuses_the_same_world_and_replaces_another_only_with_overwrite(tiny_world, tmp_path):
    world = _world(tiny_world, tmp_path)
    manifest = json.loads((world / "manifest.json").read_text())
    _refused_leaving_all(tmp_path, ["build-world", "--scale", "test", "--out", world / "inner"], "lies inside the world")
    _refused_leaving_all(tmp_path, ["build-world", "--seed", 1, "--scale", "test", "--out", world],
                         f"already holds world {manifest['world_hash']}", "--overwrite")
    before = _tree(world)
    same = _ok(_run("build-world", "--seed", 0, "--scale", "test", "--out", world))  # exactly that world: reused
    assert same["world_hash"] == manifest["world_hash"] and _tree(world) == before
    assert [r[1] for r in _store()["runs"]] == ["FINISHED"]
    from rlhf_mlflow.steps.build_world import _check_world_out  # with --overwrite: to be rebuilt (a build
    assert _check_world_out(str(world), 1, [], "test", overwrite=True) is None  # takes a minute here)


# the pure check ---------------------------------------------------------------------------------------

def test_check_out_is_free_compares_resolved_paths(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "in.jsonl").write_text("{}\n")
    os.symlink(tmp_path / "d", tmp_path / "d2")
    with pytest.raises(InputError, match="--out .*: is --in "):
        files.check_out_is_free(str(tmp_path / "d2" / "in.jsonl"), {"--in": str(tmp_path / "d" / "in.jsonl")})
    with pytest.raises(InputError, match="contains --in"):
        files.check_out_is_free(str(tmp_path / "d2"), {"--in": str(tmp_path / "d" / "in.jsonl")})
    with pytest.raises(InputError, match="lies inside the store"):
        files.check_out_is_free(str(tmp_path / "d2" / "x"), protected=[("the store", str(tmp_path / "d"))])
    files.check_out_is_free(str(tmp_path / "d" / "out.json"), {"--in": str(tmp_path / "d" / "in.jsonl")},
                            [("the store", str(tmp_path / "elsewhere"))])  # beside an input is fine


def test_the_portable_commands_refuse_an_out_onto_their_input(tiny_world, tmp_path, capsys):
    from rlhf_mlflow.cli.portable import certify_main
    world = _world(tiny_world, tmp_path)
    loose = tmp_path / "gold.jsonl"
    shutil.copy(world / "data" / "gold_calib.jsonl", loose)
    before = _tree(tmp_path)
    for out in (loose, world / "data" / "gold_calib.jsonl"):
        assert certify_main(["--policy", str(world / "policy"), "--reference", str(world / "policy"),
                             "--gold", str(loose), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is --gold" in err and "lies inside the world" in err
    assert _tree(tmp_path) == before
