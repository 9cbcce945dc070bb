"""The `rlhf-mlflow` commands end to end on a tiny world, through click's CliRunner."""
from __future__ import annotations

import json
import os

from click.testing import CliRunner

from rlhf_mlflow.cli import cli


def _run(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res


def test_build_world_test_scale(tmp_path):
    res = _run("build-world", "--seed", 5, "--scale", "test", "--out", tmp_path / "w")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{"):])
    assert out["world"] == str(tmp_path / "w")
    assert os.path.isfile(tmp_path / "w" / "reward_model" / "rm.safetensors")


def test_build_world_with_a_spec_file(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([{"family": "anvil", "kind": "pair", "tokens": ["ba", "da"], "bonus": -0.4}]))
    res = _run("build-world", "--scale", "test", "--spec", spec, "--out", tmp_path / "w")
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert manifest["spec"][0]["tokens"] == ["ba", "da"]


def test_build_world_rejects_a_bad_spec(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([{"family": "anvil", "kind": "token", "token": "qq", "bonus": 1}]))
    res = _run("build-world", "--scale", "test", "--spec", spec, "--out", tmp_path / "w")
    assert res.exit_code == 1
    assert "unknown token 'qq'" in res.output and "valid tokens are" in res.output
    assert not (tmp_path / "w").exists()


def test_train_rl_dev_eval_and_bon(tiny_world, tmp_path):
    out = tmp_path / "run"
    res = _run("train-rl", "--config", os.path.join(tiny_world, "configs", "default.json"),
               "--override", "steps=4", "--override", "log_every=2", "--override", "save_every=2", "--out", out)
    assert res.exit_code == 0, res.output
    assert (out / "policy.safetensors").is_file() and (out / "step_2" / "policy.safetensors").is_file()
    lines = (out / "log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 4]
    assert json.loads((out / "run_config.json").read_text())["steps"] == 4

    res = _run("dev-eval", "--policy", out, "--policy-ref", os.path.join(tiny_world, "policy"),
               "--reward-model", os.path.join(tiny_world, "reward_model"),
               "--prompts", os.path.join(tiny_world, "data", "prompts_dev.jsonl"),
               "--gold", os.path.join(tiny_world, "data", "gold_calib.jsonl"), "--out", tmp_path / "dev.json")
    assert res.exit_code == 0, res.output
    metrics = json.loads((tmp_path / "dev.json").read_text())
    assert {"proxy_mean", "proxy_std", "proxy_p50", "proxy_p90", "kl_mean", "rm_gold_pearson",
            "proxy/dune", "kl/balanced", "proxy/pilot"} <= set(metrics)

    res = _run("bon", "--policy", out, "--reward-model", os.path.join(tiny_world, "reward_model"),
               "--prompts", os.path.join(tiny_world, "data", "prompts_dev.jsonl"), "--n", 4, "--limit", 10,
               "--out", tmp_path / "bon.jsonl")
    assert res.exit_code == 0, res.output
    rows = (tmp_path / "bon.jsonl").read_text().splitlines()
    assert len(rows) == 10 and len(json.loads(rows[0])["response"]) == 8
    m = json.loads(res.output)
    assert m["bon_proxy/balanced"] >= m["sample_proxy/balanced"]


def test_train_rl_bad_override_is_one_clear_error(tiny_world, tmp_path):
    res = _run("train-rl", "--config", os.path.join(tiny_world, "configs", "default.json"),
               "--override", "kl_coeff=0.05", "--out", tmp_path / "run")
    assert res.exit_code == 1
    assert res.output.strip().startswith("Error:") and "unknown config key 'kl_coeff'" in res.output
    assert "Traceback" not in res.output


def test_train_rm_cli(tiny_world, tmp_path):
    res = _run("train-rm", "--data", os.path.join(tiny_world, "reward_model", "train.jsonl"), "--epochs", 2,
               "--out", tmp_path / "rm")
    assert res.exit_code == 0, res.output
    fit = json.loads(res.output[res.output.index("{"):])["fit"]
    assert set(fit) == {"anvil", "birch", "cobalt", "dune", "ember", "fjord"}
    assert (tmp_path / "rm" / "rm.safetensors").is_file()


def test_missing_prompt_file_names_the_file(tiny_world, tmp_path):
    res = _run("train-rl", "--config", os.path.join(tiny_world, "configs", "default.json"),
               "--override", f"prompt_file={tmp_path / 'nope.jsonl'}", "--override", "steps=1", "--out", tmp_path / "r")
    assert res.exit_code == 1
    assert "nope.jsonl: file not found" in res.output
