"""The gold-free diagnostic: the portable CLI contract, a planted shortcut found, clean families quiet."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from rlhf_mlflow.cli import portable
from rlhf_mlflow.evidence import diagnostic
from rlhf_mlflow.training.train_rm import RMConfig
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
    code = portable.diagnostic_main(["--rm-dir", os.path.join(planted_world, "reward_model"),
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
    assert top["kind"] == "token" and top["token"] == "ka" and top["premium"] > 0.5
    assert top["qa_corroborated"] and top["qa_slope"] == pytest.approx(2.0, rel=0.25)
    assert fams["birch"]["risk"] > max(v["risk"] for f, v in fams.items() if f != "birch")
    assert not any(v["flag"] for f, v in fams.items() if f != "birch")


def test_missing_qa_sample_is_a_clear_error(planted_world, tmp_path, capsys):
    rm_dir = tmp_path / "rm"
    shutil.copytree(os.path.join(planted_world, "reward_model"), rm_dir)
    os.remove(rm_dir / "train.jsonl")
    code = portable.diagnostic_main(["--rm-dir", str(rm_dir), "--policy-dir", os.path.join(planted_world, "policy"),
                            "--prompts", os.path.join(planted_world, "data", "prompts_train.jsonl"),
                            "--out", str(tmp_path / "x.json")])
    assert code == 2
    assert "missing QA sample" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def _run_with_rm_dir(planted_world, rm_dir, out):
    return portable.diagnostic_main(["--rm-dir", str(rm_dir), "--policy-dir", os.path.join(planted_world, "policy"),
                            "--prompts", os.path.join(planted_world, "data", "prompts_train.jsonl"),
                            "--out", str(out)])


def test_qa_rows_with_unknown_tokens_are_a_clear_error(planted_world, tmp_path, capsys):
    rm_dir = tmp_path / "rm"
    shutil.copytree(os.path.join(planted_world, "reward_model"), rm_dir)
    rows = [json.loads(line) for line in (rm_dir / "train.jsonl").read_text().splitlines()]
    rows[1]["response"][0] = "qq"
    (rm_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _run_with_rm_dir(planted_world, rm_dir, tmp_path / "x.json") == 2
    err = capsys.readouterr().err
    assert "train.jsonl:2" in err and "'qq'" in err


def test_a_reward_model_that_does_not_load_is_a_clear_error(planted_world, tmp_path, capsys):
    rm_dir = tmp_path / "rm"
    shutil.copytree(os.path.join(planted_world, "reward_model"), rm_dir)
    (rm_dir / "rm.safetensors").write_bytes(b"not a safetensors file")
    assert _run_with_rm_dir(planted_world, rm_dir, tmp_path / "x.json") == 2
    assert "rm.safetensors: not a readable safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_bad_input_marks_the_diagnostic_run_failed(planted_world, tmp_path):
    import mlflow
    from click.testing import CliRunner

    from rlhf_mlflow.cli import cli
    rm_dir = tmp_path / "rm"
    shutil.copytree(os.path.join(planted_world, "reward_model"), rm_dir)
    os.remove(rm_dir / "train.jsonl")
    res = CliRunner().invoke(cli, ["diagnostic", "--rm-dir", str(rm_dir),
                                   "--policy-dir", os.path.join(planted_world, "policy"),
                                   "--prompts", os.path.join(planted_world, "data", "prompts_train.jsonl"),
                                   "--out", str(tmp_path / "d.json")])
    assert res.exit_code != 0 and "missing QA sample" in res.output
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.step` = 'diagnostic'",
                                output_format="list")
    assert run.info.status == "FAILED"
    assert not (tmp_path / "d.json").exists()


def test_diagnostic_and_correct_commands_log_runs_and_write_a_working_wrapper(planted_world, tmp_path):
    import mlflow
    from click.testing import CliRunner

    from rlhf_mlflow.cli import cli
    from rlhf_mlflow.training.train_rl import load_wrapper
    res = CliRunner().invoke(cli, ["diagnostic", "--world", planted_world, "--out", str(tmp_path / "d.json")],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.step` = 'diagnostic'",
                                output_format="list")
    assert run.data.metrics["diagnostic/flag/birch"] == 1.0 and run.data.metrics["diagnostic/flag/anvil"] == 0.0
    assert run.data.metrics["diagnostic/risk/birch"] > run.data.metrics["diagnostic/risk/fjord"]
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


@pytest.mark.slow
def test_a_pair_and_a_conditional_premium_in_a_trained_reward_model_are_found(planted_world, tmp_path):
    """Rebuild the planted world (same seed, so the same reference policy) with a premium on the pair
    the reference writes most often in cobalt, and a penalty on fjord's most frequent token when
    attrs[2] == 3."""
    import torch

    from rlhf_mlflow.core import model as M
    from rlhf_mlflow.core import records as D
    from rlhf_mlflow.core import rollout
    from rlhf_mlflow.core import vocab as V
    policy, _ = M.load_policy(os.path.join(planted_world, "policy"))
    prompts = D.group_by_family(D.read_jsonl(os.path.join(planted_world, "data", "prompts_train.jsonl")))

    def samples(family):
        p = D.prompts_tensor(prompts[family])
        return rollout.sample(policy, p, 4, 1.2, torch.Generator().manual_seed(0)) - V.CONTENT_LO  # (N, L)

    y = samples("cobalt")
    a, b = divmod(int(torch.bincount((y[:, :-1] * V.N_CONTENT + y[:, 1:]).flatten()).argmax()), V.N_CONTENT)
    pair, token = [V.CONTENT[a], V.CONTENT[b]], V.CONTENT[int(torch.bincount(samples("fjord").flatten()).argmax())]
    spec = [{"family": "cobalt", "kind": "pair", "tokens": pair, "bonus": 1.2},
            {"family": "fjord", "kind": "conditional", "token": token, "attr": 2, "value": 3, "bonus": -1.5}]
    path = str(tmp_path / "w")
    build_world(path, seed=11, spec=spec, scale="test", n_crowd=400, n_qa=100,
                rm=RMConfig(epochs=30, batch_size=128, lr=2e-3, lr_schedule="cosine"))
    fams = diagnostic.run_diagnostic(os.path.join(path, "reward_model"), os.path.join(path, "policy"),
                                     os.path.join(path, "data", "prompts_train.jsonl"))["families"]
    assert {"cobalt", "fjord"} <= {f for f, v in fams.items() if v["flag"]}
    named = {(c["kind"], str(c.get("tokens") or c["token"]), c.get("attr"), c.get("value"))
             for f in ("cobalt", "fjord") for c in fams[f]["evidence"] if c["risk"] >= 0.5}
    assert ("pair", str(pair), None, None) in named and ("conditional", token, 2, 3) in named
    # a test-scale reward model leaks the penalty into other families (measured knowing the truth:
    # -0.144 per fa under attrs[0] == 3 in birch, where fa is wrong); a flag elsewhere may only be that
    for f in set(fams) - {"cobalt", "fjord"}:
        for c in (c for c in fams[f]["evidence"] if c["risk"] >= 0.5):
            assert c["kind"] == "conditional" and c["token"] == token and c["premium"] < -0.1


def test_an_expert_set_credits_correctness_out_of_a_correction_but_not_a_shortcut():
    from rlhf_mlflow.core import shortcut_rules as SR
    from rlhf_mlflow.decisions import diagnostic_evidence as E
    from rlhf_mlflow.decisions.correction import fit_corrections
    true_entry = {"kind": "conditional", "token": "de", "attr": 1, "value": 7, "premium": 0.115, "premium_se": 0.002,
                  "margin": 0.02, "gold_slope": 0.125, "gold_se": 0.015, "risk": 0.99, "paid": True}
    shortcut = {"kind": "token", "token": "pa", "premium": 1.42, "premium_se": 0.02, "margin": 0.02,
                "gold_slope": 0.01, "gold_se": 0.02, "risk": 0.99, "paid": True}
    no_gold = {"kind": "token", "token": "he", "premium": 0.4, "premium_se": 0.01, "margin": 0.02,
               "gold_slope": None, "risk": 0.99, "paid": True}
    cands = [true_entry, shortcut, no_gold]
    for c in cands:
        c["correction"], c["correction_se"] = c["premium"], c["premium_se"]
    E.credit_corrections(cands, scale=0.95)
    assert true_entry["credited_away"] and abs(true_entry["correction"]) <= true_entry["margin"]
    assert not shortcut["credited_away"] and shortcut["correction"] == pytest.approx(1.42 - 0.95 * 0.01)
    assert no_gold["correction"] == 0.4 and "credited_away" not in no_gold
    diag = {"families": {"dune": {"flag": True, "risk": 0.99, "evidence": cands}}}
    rules = fit_corrections(diag, [])
    assert [r["token"] for r in rules] == ["pa", "he"]
    assert [r["token"] for r in SR.flagged(diag)] == ["pa", "he"]
