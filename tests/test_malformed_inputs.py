"""Malformed input files, each through the real CLI: a field of the wrong type, a byte that is not
UTF-8, nesting too deep to read, a diagnostic that is not one, a model config too large to allocate.
Each is exactly one error line naming the file (and line), no traceback, no run that finished and an
untouched registry (issue 28: each of these was a traceback)."""
from __future__ import annotations

import json
import os
import re
import shutil

import mlflow
import pytest
from click.testing import CliRunner

from rlhf_mlflow.cli import cli

MLFLOW_LOG = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (INFO|WARNING) mlflow")  # a fresh store's own lines


def _copy_lines(src: str, dst, edit_line: int, edit) -> str:
    """The first three lines of `src` with line `edit_line` (1-based) replaced by edit(line) (str or bytes)."""
    lines = open(src, "rb").read().splitlines()[:3]
    new = edit(lines[edit_line - 1].decode())
    lines[edit_line - 1] = new if isinstance(new, bytes) else new.encode()
    dst.write_bytes(b"\n".join(lines) + b"\n")
    return str(dst)


def _list_id(world, tmp):
    path = _copy_lines(f"{world}/data/gold_calib.jsonl", tmp / "labels.jsonl", 2,
                       lambda line: json.dumps({**json.loads(line), "id": [1, 2]}))
    return (["certify", "--policy", f"{world}/policy", "--world", world, "--policy-labels", path],
            [f"{path}:2: field 'id' must be a string or an integer, got a list [1, 2]"])


def _bad_byte_jsonl(world, tmp):
    path = _copy_lines(f"{world}/data/prompts_dev.jsonl", tmp / "prompts.jsonl", 2,
                       lambda line: line.replace('"family"', '"fam\xff"').encode("latin-1"))
    offset = open(path, "rb").read().index(b"\xff")
    return (["dev-eval", "--policy", f"{world}/policy", "--world", world, "--prompts", path],
            [f"{path}:2: not UTF-8 text (byte 0xff at byte offset {offset})"])


def _deep_line(world, tmp):
    path = _copy_lines(f"{world}/data/gold_calib.jsonl", tmp / "gold.jsonl", 3, lambda line: "[" * 100_000)
    return (["dev-eval", "--policy", f"{world}/policy", "--world", world, "--gold", path],
            [f"{path}:3: JSON nested more than 64 levels deep"])


def _diagnostic(tmp, body) -> str:
    path = tmp / "diagnostic.json"
    path.write_text(json.dumps(body))
    return str(path)


def _diagnostic_list(world, tmp):
    path = _diagnostic(tmp, [{"family": "dune", "kind": "token", "token": "pa"}])
    return (["certify", "--policy", f"{world}/policy", "--world", world, "--diagnostic", path],
            [f"{path}: expected a diagnostic result", "got a list"])


UNKNOWN_TOKEN = {"families": {"dune": {"risk": 0.9, "flag": True, "evidence": [
    {"kind": "token", "token": "pa", "risk": 0.9}, {"kind": "token", "token": "xyz", "risk": 0.8}]}}}


def _diagnostic_token(world, tmp):
    path = _diagnostic(tmp, UNKNOWN_TOKEN)
    return (["certify", "--policy", f"{world}/policy", "--world", world, "--diagnostic", path],
            [f"{path}: families.dune.evidence[1]: unknown token 'xyz'; valid tokens are ['ba', "])


def _correct_token(world, tmp):
    path = _diagnostic(tmp, UNKNOWN_TOKEN)
    return (["correct", "--diagnostic", path, "--qa", f"{world}/reward_model/train.jsonl", "--out", str(tmp / "w.py")],
            [f"{path}: families.dune.evidence[1]: unknown token 'xyz'; valid tokens are ['ba', "])


def _deep_family_weights(world, tmp):
    return (["train-rl", "--world", world, "--family-weights", "[" * 100_000 + "]" * 100_000],
            ["--family-weights: JSON nested more than 64 levels deep"])


def _bad_config(world, tmp, which: str, **changes) -> str:
    dst = tmp / f"bad_{which}"
    shutil.copytree(os.path.join(world, which), dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return str(dst)


def _huge_policy(world, tmp):
    bad = _bad_config(world, tmp, "policy", d_model=4_000_000)
    return (["dev-eval", "--policy", bad, "--world", world],
            [f"{bad}/config.json: 'd_model' must be an integer in [1, 4096], got 4000000"])


def _huge_reward_model(world, tmp):
    bad = _bad_config(world, tmp, "reward_model", d_model=4096, n_layers=64, d_ff=16384)
    return (["dev-eval", "--policy", f"{world}/policy", "--world", world, "--reward-model", bad],
            [f"{bad}/config.json: d_model 4096, n_layers 64 and d_ff 16384 make about 12.9B parameters; "
             "at most 1B are allowed"])


def _bad_byte_json(world, tmp):
    path = tmp / "recipe.json"
    text = open(f"{world}/configs/default.json", "rb").read()
    cut = text.index(b"\n", 1) + 1  # the second line gets the bad byte
    path.write_bytes(text[:cut] + b"\xc3(" + text[cut:])
    return (["train-rl", "--world", world, "--config", str(path)],
            [f"{path}:2: not UTF-8 text (byte 0xc3 at byte offset {cut})"])


CASES = {"labels with a list id": (_list_id, "certify"),
         "a JSONL file with a non-UTF-8 byte": (_bad_byte_jsonl, "dev_eval"),
         "a JSONL line nested 100000 deep": (_deep_line, "dev_eval"),
         "--diagnostic a JSON list": (_diagnostic_list, "certify"),
         "--diagnostic with an unknown token": (_diagnostic_token, "certify"),
         "correct --diagnostic with an unknown token": (_correct_token, "correction"),
         "a policy config with d_model 4e6": (_huge_policy, "dev_eval"),
         "a reward-model config of 13B parameters": (_huge_reward_model, "dev_eval"),
         "a JSON recipe with a non-UTF-8 byte": (_bad_byte_json, "train_rl"),
         "--family-weights nested 100000 deep": (_deep_family_weights, "train_rl")}


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_input_is_one_line_naming_the_file(tiny_world, tmp_path, case):
    make, step = CASES[case]
    args, needles = make(tiny_world, tmp_path)
    res = CliRunner().invoke(cli, ["-q", *args])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.output, repr(res.exception))
    assert "Traceback" not in res.output
    lines = [x for x in res.output.splitlines() if x.strip() and not MLFLOW_LOG.match(x)]
    assert len(lines) == 1, res.output
    (line,) = lines
    assert line.startswith("Error: ")
    for needle in needles:
        assert needle in line, line
    runs = mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.`rlhf.step` = '{step}'",
                              output_format="list")
    assert [r.info.status for r in runs] in ([], ["FAILED"])  # refused before its run, or its run FAILED
    assert not mlflow.MlflowClient().search_registered_models()
