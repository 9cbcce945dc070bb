"""Format round trips: checkpoints in the seed's layout, JSONL records, bad input."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError


class SeedAttention(nn.Module):
    """The seed's module layout, written independently: qkv + out, torch's fused attention."""

    def __init__(self, d, h):
        super().__init__()
        self.h, self.dk = h, d // h
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, causal):
        B, T, Dm = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dk).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(a.transpose(1, 2).reshape(B, T, Dm))


class SeedBlock(nn.Module):
    def __init__(self, d, h, dff):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), SeedAttention(d, h)
        self.ln2, self.ff = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, dff), nn.GELU(), nn.Linear(dff, d))

    def forward(self, x, causal=True):
        x = x + self.attn(self.ln1(x), causal)
        return x + self.ff(self.ln2(x))


class SeedPolicy(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.tok, self.pos = nn.Embedding(cfg["vocab_size"], d), nn.Embedding(cfg["seq_len"], d)
        self.blocks = nn.ModuleList([SeedBlock(d, cfg["n_heads"], cfg["d_ff"]) for _ in range(cfg["n_layers"])])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, cfg["vocab_size"], bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))[None]
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        out = torch.full_like(logits, -1e9)
        out[..., V.CONTENT_LO:V.CONTENT_HI] = logits[..., V.CONTENT_LO:V.CONTENT_HI]
        return out


def _write_seed_checkpoint(module, cfg, d, weights):
    os.makedirs(d, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()}, os.path.join(d, weights))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def _ids(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.cat([torch.randint(2, 8, (n, 1), generator=g), torch.randint(8, 16, (n, 4), generator=g),
                         torch.full((n, 1), V.SEP)], 1)
    return prompts, torch.randint(V.CONTENT_LO, V.CONTENT_HI, (n, V.RESP_LEN), generator=g)


def test_seed_layout_checkpoint_loads_and_computes_the_same_logits(tmp_path):
    torch.manual_seed(0)
    cfg = M.default_config()
    seed_policy = SeedPolicy(cfg).eval()
    _write_seed_checkpoint(seed_policy, cfg, tmp_path / "p", "policy.safetensors")
    ours, loaded_cfg = M.load_policy(str(tmp_path / "p"))
    assert loaded_cfg == cfg
    prompts, resp = _ids()
    ids = torch.cat([prompts, resp], 1)
    with torch.no_grad():
        assert torch.allclose(ours(ids), seed_policy(ids), atol=1e-5)


def test_our_checkpoint_loads_in_the_seed_layout(tmp_path):
    torch.manual_seed(1)
    policy = M.Policy(M.default_config()).eval()
    M.save_policy(policy, M.default_config(), str(tmp_path / "p"))
    with open(tmp_path / "p" / "config.json") as f:
        cfg = json.load(f)
    assert set(cfg) == {"vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len", "prompt_len", "resp_len"}
    seed_policy = SeedPolicy(cfg)
    from safetensors.torch import load_file
    seed_policy.load_state_dict(load_file(str(tmp_path / "p" / "policy.safetensors")))  # strict: same keys
    prompts, resp = _ids()
    ids = torch.cat([prompts, resp], 1)
    with torch.no_grad():
        assert torch.allclose(policy(ids), seed_policy.eval()(ids), atol=1e-5)


def test_reward_model_round_trip(tmp_path):
    torch.manual_seed(2)
    rm = R.RewardModel(R.default_config()).eval()
    R.save_rm(rm, R.default_config(), str(tmp_path / "rm"))
    rm2, cfg = R.load_rm(str(tmp_path / "rm"))
    prompts, resp = _ids(7)
    assert cfg == R.default_config()
    assert torch.equal(R.score(rm, prompts, resp), R.score(rm2, prompts, resp))
    assert set(rm2.state_dict()) == set(rm.state_dict())
    assert "head.0.weight" in rm.state_dict() and "blocks.1.attn.qkv.weight" in rm.state_dict()


def test_checkpoint_whose_config_does_not_match_its_weights_is_refused(tmp_path):
    policy = M.Policy(M.default_config())
    M.save_policy(policy, M.default_config(), str(tmp_path / "p"))
    cfg = dict(M.default_config(), d_model=32)
    with open(tmp_path / "p" / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(InputError, match=r"weights do not match .*config.json"):
        M.load_policy(str(tmp_path / "p"))


def test_checkpoint_missing_config_key_names_the_key(tmp_path):
    policy = M.Policy(M.default_config())
    M.save_policy(policy, M.default_config(), str(tmp_path / "p"))
    cfg = M.default_config()
    del cfg["resp_len"]
    with open(tmp_path / "p" / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(InputError, match="resp_len"):
        M.load_policy(str(tmp_path / "p"))


def test_jsonl_round_trip(tmp_path):
    recs = [{"id": "a", "family": "dune", "attrs": [1, 2, 3, 4], "response": ["pa"] * 8, "label": 0.5},
            {"id": "b", "family": "fjord", "attrs": [0, 0, 7, 7], "response": V.CONTENT[:8], "label": -0.1}]
    D.write_jsonl(str(tmp_path / "x.jsonl"), recs)
    back = D.read_jsonl(str(tmp_path / "x.jsonl"), labelled=True)
    assert back == recs
    p = D.prompts_tensor(back)
    assert p.tolist()[0] == V.encode_prompt("dune", [1, 2, 3, 4])
    assert D.responses_tensor(back)[1].tolist() == V.encode_response(V.CONTENT[:8])


@pytest.mark.parametrize("line,match", [
    ('{"id": "x", "family": "dune", "attrs": [1, 2, 3', r"bad\.jsonl:2: malformed JSON"),
    ('{"id": "x", "family": "tundra", "attrs": [1, 2, 3, 4]}', r"bad\.jsonl:2: unknown family 'tundra'.*anvil"),
    ('{"id": "x", "family": "dune", "attrs": [1, 2, 3, 9]}', r"bad\.jsonl:2: 'attrs' must be 4 integers in 0\.\.7"),
    ('{"id": "x", "family": "dune", "attrs": [1, 2, 3, 4], "response": ["pa","pa","pa","pa","pa","pa","pa","xx"],'
     ' "label": 1}', r"bad\.jsonl:2: unknown response token 'xx'"),
])
def test_bad_records_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "ok", "family": "anvil", "attrs": [0, 0, 0, 0]}\n' + line + "\n")
    with pytest.raises(InputError, match=match):
        D.read_jsonl(str(path))


def test_labelled_reader_requires_labels(tmp_path):
    path = tmp_path / "gold.jsonl"
    path.write_text('{"id": "g", "family": "anvil", "attrs": [0, 0, 0, 0], "response": ' + json.dumps(["ba"] * 8)
                    + "}\n")
    with pytest.raises(InputError, match=r"gold\.jsonl:1 \(id 'g'\): 'label' must be a finite number"):
        D.read_jsonl(str(path), labelled=True)
