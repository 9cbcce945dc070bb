"""The gold-free diagnostic: the portable CLI contract, a planted shortcut found, clean families quiet."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from rlhf_mlflow import diagnostic
from rlhf_mlflow.train_rm import RMConfig
from rlhf_mlflow.world.build import build_world


@pytest.fixture(scope="module")
def planted_world(tmp_path_factory):
    """A small world whose crowd pays +2.0 per 'ka' in birch, with a reward model trained to learn it."""
    path = str(tmp_path_factory.mktemp("planted") / "w")
    spec = [{"family": "birch", "kind": "token", "token": "ka", "bonus": 2.0}]
    build_world(path, seed=11, spec=spec, scale="test", n_crowd=400, n_qa=100,
                rm=RMConfig(epochs=30, batch_size=128, lr=2e-3, lr_schedule="cosine"))
    return path


def test_portable_cli_writes_the_contract(planted_world, tmp_path):
    out = tmp_path / "diag.json"
    code = diagnostic.main(["--rm-dir", os.path.join(planted_world, "reward_model"),
                            "--policy-dir", os.path.join(planted_world, "policy"),
                            "--prompts", os.path.join(planted_world, "data", "prompts_train.jsonl"),
                            "--out", str(out)])
    assert code == 0
    fams = json.loads(out.read_text())["families"]
    assert set(fams) == {"anvil", "birch", "cobalt", "dune", "ember", "fjord"}
    for f, v in fams.items():
        assert 0.0 <= v["risk"] <= 1.0 and isinstance(v["flag"], bool)
    assert fams["birch"]["flag"]
    top = fams["birch"]["evidence"][0]
    assert top["kind"] == "token" and top["token"] == "ka" and top["effect"] > 0.5
    assert top["qa_corroborated"] and top["qa_slope"] == pytest.approx(2.0, rel=0.25)
    assert fams["birch"]["risk"] > max(v["risk"] for f, v in fams.items() if f != "birch")
    assert not any(v["flag"] for f, v in fams.items() if f != "birch")


def test_missing_qa_sample_is_a_clear_error(planted_world, tmp_path, capsys):
    rm_dir = tmp_path / "rm"
    shutil.copytree(os.path.join(planted_world, "reward_model"), rm_dir)
    os.remove(rm_dir / "train.jsonl")
    code = diagnostic.main(["--rm-dir", str(rm_dir), "--policy-dir", os.path.join(planted_world, "policy"),
                            "--prompts", os.path.join(planted_world, "data", "prompts_train.jsonl"),
                            "--out", str(tmp_path / "x.json")])
    assert code == 2
    assert "missing QA sample" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_diagnostic_and_correct_commands_log_runs_and_write_a_working_wrapper(planted_world, tmp_path):
    import mlflow
    from click.testing import CliRunner

    from rlhf_mlflow.cli import cli
    from rlhf_mlflow.train_rl import load_wrapper
    res = CliRunner().invoke(cli, ["diagnostic", "--world", planted_world, "--out", str(tmp_path / "d.json")],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.step` = 'diagnostic'",
                                output_format="list")
    assert run.data.metrics["flag/birch"] == 1.0 and run.data.metrics["flag/anvil"] == 0.0
    assert run.data.metrics["risk/birch"] > run.data.metrics["risk/fjord"]
    res = CliRunner().invoke(cli, ["correct", "--diagnostic", str(tmp_path / "d.json"),
                                   "--qa", os.path.join(planted_world, "reward_model", "train.jsonl"),
                                   "--out", str(tmp_path / "wrap.py")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rules = json.loads(res.output)["rules"]
    assert [(r["family"], r["token"]) for r in rules] == [("birch", "ka")]
    assert rules[0]["bonus"] == pytest.approx(2.0, rel=0.25)
    transform = load_wrapper(str(tmp_path / "wrap.py"))
    recs = [{"family": "birch", "attrs": [0] * 4}, {"family": "anvil", "attrs": [0] * 4}]
    toks = [["ka", "ka"] + ["ba"] * 6, ["ka"] * 8]
    out = transform(recs, toks, [5.0, 5.0])
    assert out == pytest.approx([5.0 - 2 * rules[0]["bonus"], 5.0])
