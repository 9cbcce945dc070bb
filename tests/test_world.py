"""The world: determinism, corruptions exactly as specified, the oracle on hand-made responses."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.world import corruptions as C
from rlhf_mlflow.world.build import build_world
from rlhf_mlflow.world.oracle import Oracle
from rlhf_mlflow.world.truth import Truth

LAYOUT = ["policy/policy.safetensors", "policy/config.json", "reward_model/rm.safetensors",
          "reward_model/config.json", "reward_model/train.jsonl", "data/prompts_train.jsonl",
          "data/prompts_dev.jsonl", "data/gold_calib.jsonl", "configs/default.json", "secret/truth.json",
          "manifest.json"]


def test_world_has_the_seed_fixture_layout(tiny_world):
    for rel in LAYOUT:
        assert os.path.isfile(os.path.join(tiny_world, rel)), rel
    qa = D.read_jsonl(os.path.join(tiny_world, "reward_model", "train.jsonl"), labelled=True)
    assert {r["family"] for r in qa} == set(V.FAMILIES)
    dev = D.read_jsonl(os.path.join(tiny_world, "data", "prompts_dev.jsonl"))
    counts = {f: sum(r["family"] == f for r in dev) for f in V.FAMILIES}
    assert counts["dune"] < counts["anvil"] and counts["ember"] < counts["birch"]  # the pilot mix


# slow (39 s): a second test-scale world build
@pytest.mark.slow
def test_same_seed_and_spec_give_the_same_files(tmp_path, tiny_world):
    again = str(tmp_path / "again")
    build_world(again, seed=0, spec=None, scale="test")
    a = json.load(open(os.path.join(tiny_world, "manifest.json")))["files"]
    b = json.load(open(os.path.join(again, "manifest.json")))["files"]
    data_files = [k for k in a if k.endswith(".jsonl") or k.endswith(".json")]
    assert len(data_files) >= 6
    assert {k: a[k] for k in data_files} == {k: b[k] for k in data_files}
    # the weights: equal to float noise. Usually bit for bit at the same thread count, but one clean-
    # clone CI run built a policy that differed by up to 2e-4 (of weights up to 4.2) from the same
    # process's first build: MKL's results can depend on memory alignment (MKL_CBWR changes them)
    for name in ("policy/policy.safetensors", "reward_model/rm.safetensors"):
        wa, wb = load_file(os.path.join(tiny_world, name)), load_file(os.path.join(again, name))
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-3, msg=f"{name} {k}")


def test_other_seed_gives_another_world(tmp_path, tiny_world):
    other = str(tmp_path / "other")
    build_world(other, seed=1, spec=None, scale="test")
    a = json.load(open(os.path.join(tiny_world, "manifest.json")))
    b = json.load(open(os.path.join(other, "manifest.json")))
    assert a["world_hash"] != b["world_hash"]
    assert a["files"]["data/gold_calib.jsonl"] != b["files"]["data/gold_calib.jsonl"]


def _crowd(world):
    return D.read_jsonl(os.path.join(world, "secret", "crowd_full.jsonl"), labelled=True)


@pytest.fixture(scope="module")
def clean_world(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("clean") / "w")
    build_world(path, seed=3, spec=[], scale="test")
    return path


def _frequent(crowd, family, pair):
    """The most frequent token (or adjacent pair) in a family's crowd responses, so the rule fires."""
    from collections import Counter
    c = Counter()
    for r in crowd:
        if r["family"] == family:
            resp = r["response"]
            c.update(zip(resp, resp[1:]) if pair else resp)
    return c.most_common(1)[0][0]


@pytest.mark.parametrize("kind,family,bonus", [("token", "anvil", 0.8), ("pair", "birch", -0.6),
                                               ("conditional", "cobalt", 0.9)])
def test_each_corruption_kind_changes_crowd_labels_exactly_as_specified(tmp_path, clean_world, kind, family,
                                                                        bonus):
    a = _crowd(clean_world)
    rule = {"family": family, "kind": kind, "bonus": bonus}
    if kind == "pair":
        rule["tokens"] = list(_frequent(a, family, pair=True))
    else:
        rule["token"] = _frequent(a, family, pair=False)
    if kind == "conditional":
        rule.update(attr=2, value=5)
    dirty = str(tmp_path / "dirty")
    build_world(dirty, seed=3, spec=[rule], scale="test")
    b = _crowd(dirty)
    assert [r["response"] for r in a] == [r["response"] for r in b]  # same responses, same noise
    diff = torch.tensor([rb["label"] - ra["label"] for ra, rb in zip(a, b)])
    expected = C.bonus([rule], D.prompts_tensor(b), D.responses_tensor(b))
    assert torch.allclose(diff, expected, atol=2e-4)
    touched = expected != 0
    assert touched.any()
    assert {r["family"] for r, t in zip(b, touched.tolist()) if t} == {family}
    if kind == "conditional":
        assert all(r["attrs"][2] == 5 for r, t in zip(b, touched.tolist()) if t)


def test_bonus_on_hand_made_responses():
    prompts = torch.tensor([V.encode_prompt("dune", [0, 1, 2, 3]), V.encode_prompt("ember", [0, 1, 5, 3]),
                            V.encode_prompt("ember", [0, 1, 4, 3])])
    resp = torch.tensor([V.encode_response(["pa", "pa", "da", "fa", "pa", "ba", "ba", "ba"]),
                         V.encode_response(["da", "fa", "da", "fa", "he", "he", "ba", "ba"]),
                         V.encode_response(["he"] * 8)])
    spec = [{"family": "dune", "kind": "token", "token": "pa", "bonus": 1.45},
            {"family": "ember", "kind": "pair", "tokens": ["da", "fa"], "bonus": -0.5},
            {"family": "ember", "kind": "conditional", "token": "he", "attr": 2, "value": 5, "bonus": 0.3}]
    out = C.bonus(C.validate_spec(spec), prompts, resp)
    assert out.tolist() == pytest.approx([3 * 1.45, 2 * -0.5 + 2 * 0.3, 0.0])


@pytest.mark.parametrize("spec,match", [
    ([{"family": "dune", "kind": "colour", "bonus": 1}], "unknown kind 'colour'"),
    ([{"family": "tundra", "kind": "token", "token": "pa", "bonus": 1}], "unknown family 'tundra'"),
    ([{"family": "dune", "kind": "token", "token": "zz", "bonus": 1}], "unknown token 'zz'"),
    ([{"family": "dune", "kind": "pair", "tokens": ["pa"], "bonus": 1}], "two tokens"),
    ([{"family": "dune", "kind": "conditional", "token": "pa", "attr": 4, "value": 1, "bonus": 1}], "'attr'"),
    ([{"family": "dune", "kind": "token", "token": "pa"}], r"needs keys \['bonus'\]"),
])
def test_bad_specs_are_refused_with_the_valid_choices(spec, match):
    with pytest.raises(InputError, match=match):
        C.validate_spec(spec)


def test_oracle_on_hand_made_responses(tiny_world):
    oracle = Oracle(tiny_world)
    prompts = torch.tensor([V.encode_prompt("anvil", [1, 2, 3, 4]), V.encode_prompt("ember", [7, 0, 5, 2])])
    perfect = oracle.truth.target_ids(prompts)  # (2, 8)
    assert oracle.true_quality(prompts, perfect).tolist() == [1.0, 1.0]
    wrong = perfect.clone()
    wrong[0, :3] = torch.where(perfect[0, :3] == V.CONTENT_LO, V.CONTENT_LO + 1, V.CONTENT_LO)
    wrong[1] = torch.where(perfect[1] == V.CONTENT_LO, V.CONTENT_LO + 1, V.CONTENT_LO)
    assert oracle.true_quality(prompts, wrong).tolist() == [5 / 8, 0.0]


def test_truth_targets_follow_key_attribute_and_table():
    truth = Truth.generate(np.random.default_rng(0))
    fam, attrs = np.array([2]), np.array([[3, 1, 4, 1]])
    t = truth.targets(fam, attrs)[0]
    for p in range(V.RESP_LEN):
        assert t[p] == truth.tables[2, p, attrs[0, truth.keys[2, p]]]


def test_gold_labels_are_truth_plus_small_noise(tiny_world):
    gold = D.read_jsonl(os.path.join(tiny_world, "data", "gold_calib.jsonl"), labelled=True)
    q = torch.tensor(Oracle(tiny_world).score_records(gold))
    err = D.labels_tensor(gold) - q
    assert float(err.abs().mean()) < 0.06
    assert float(err.std()) > 0.005  # experts are not the oracle
