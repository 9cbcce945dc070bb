"""What a new user meets first: building a world where `worlds/` does not exist yet, and a version
used against a world it was not trained on."""
from __future__ import annotations

import json
import shutil

import mlflow
import pytest
from click.testing import CliRunner

from rlhf_mlflow.cli import cli


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _runs(step):
    return mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.`rlhf.step` = '{step}'",
                              output_format="list")


@pytest.mark.slow
def test_build_world_makes_its_parent_directories_and_a_readable_run(tmp_path):
    out = tmp_path / "fresh" / "worlds" / "t"
    res = _run("build-world", "--scale", "test", "--out", out)
    assert res.exit_code == 0, res.output
    assert (out / "manifest.json").is_file() and (out / "policy").is_dir()
    (run,) = _runs("build_world")
    assert run.info.run_name == "build_world-test-seed0" and run.info.status == "FINISHED"
    assert run.data.params["world"] == str(out)


def test_a_version_is_refused_on_a_world_it_was_not_trained_on(tiny_world, tmp_path):
    assert _run("train-rl", "--world", tiny_world, "--steps", 2, "--batch-prompts", 4).exit_code == 0
    other = tmp_path / "other_world"
    shutil.copytree(tiny_world, other)
    manifest = json.loads((other / "manifest.json").read_text())
    trained_on, manifest["world_hash"] = manifest["world_hash"], "0123456789abcdef"
    (other / "manifest.json").write_text(json.dumps(manifest))
    before = {r.info.run_id for r in mlflow.search_runs(search_all_experiments=True, output_format="list")}
    for args in (["certify", "--model-version", 1, "--world", other], ["grade", "--model-version", 1, "--world", other],
                 ["label-requests", "--model-version", 1, "--world", other, "--out", tmp_path / "req.jsonl"]):
        res = _run(*args)
        assert res.exit_code == 1, (args, res.output)
        assert f"version 1 was trained on world {trained_on}, but {other} is world 0123456789abcdef" in res.output
    # refused before any run starts, the version untagged
    assert {r.info.run_id for r in mlflow.search_runs(search_all_experiments=True, output_format="list")} == before
    assert "certification.run_id" not in mlflow.MlflowClient().get_model_version("rlhf-policy", "1").tags
    assert _run("certify", "--model-version", 1, "--world", tiny_world).exit_code == 0
