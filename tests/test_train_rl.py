"""The RL loop: it learns, it starts at KL 0, it validates its inputs, the fast paths equal the plain ones."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.training.rl_config import RLConfig, load_rl_config
from rlhf_mlflow.training.train_rl import train_rl


def _cfg(world, **kw):
    base = dict(steps=2, batch_prompts=4, samples_per_prompt=4, log_every=1)
    base.update(kw)
    return RLConfig(**base).resolved(world)


def test_a_gradient_step_changes_the_policy(tiny_world):
    before = M.load_policy(os.path.join(tiny_world, "policy"))[0].state_dict()
    res = train_rl(_cfg(tiny_world, steps=1))
    after = res.policy.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "head.weight" in changed and "blocks.0.attn.qkv.weight" in changed


def test_kl_is_zero_at_initialisation(tiny_world):
    res = train_rl(_cfg(tiny_world, steps=1))
    step, metrics = res.history[0]
    assert step == 1
    for f in V.FAMILIES:
        if f"kl/{f}" in metrics:
            assert metrics[f"kl/{f}"] == 0.0
            assert metrics[f"kl_k3/{f}"] == 0.0


def test_metrics_are_reported_per_family_and_balanced(tiny_world):
    seen = []
    res = train_rl(_cfg(tiny_world, steps=4, log_every=2, batch_prompts=12), on_log=lambda s, m: seen.append(s))
    assert seen == [2, 4]
    metrics = res.history[-1][1]
    for name in ("proxy", "shaped", "kl", "kl_k3", "entropy", "top_token_share"):
        assert f"{name}/balanced" in metrics
    assert {"loss", "grad_norm", "steps_per_s"} <= set(metrics)
    assert 0 < metrics["top_token_share/balanced"] <= 1


def test_family_weights_restrict_the_prompts(tiny_world):
    res = train_rl(_cfg(tiny_world, family_weights={"dune": 1.0}))
    metrics = res.history[-1][1]
    assert "proxy/dune" in metrics and "proxy/anvil" not in metrics


def test_reward_wrapper_reshapes_rewards(tiny_world, tmp_path):
    wrapper = tmp_path / "wrap.py"
    wrapper.write_text("def transform(records, tokens, rewards):\n    return [r + 10.0 for r in rewards]\n")
    res = train_rl(_cfg(tiny_world, steps=1, reward_wrapper=str(wrapper)))
    m = res.history[-1][1]
    assert m["reward/balanced"] == pytest.approx(m["proxy/balanced"] + 10.0, abs=1e-4)


@pytest.mark.parametrize("body,match", [
    ("    return rewards[:-1]\n", r"returned 15 rewards for 16 responses"),
    ("    return [float('nan')] * len(rewards)\n", r"non-finite reward \(nan\) at index 0"),
    ("    raise KeyError('family')\n", r"transform raised KeyError"),
])
def test_bad_reward_wrappers_are_named(tiny_world, tmp_path, body, match):
    wrapper = tmp_path / "bad_wrap.py"
    wrapper.write_text("def transform(records, tokens, rewards):\n" + body)
    with pytest.raises(InputError, match=r"reward_wrapper .*bad_wrap\.py: .*" + match):
        train_rl(_cfg(tiny_world, steps=1, reward_wrapper=str(wrapper)))


def test_config_file_overrides_and_unknown_keys(tiny_world):
    path = os.path.join(tiny_world, "configs", "default.json")
    cfg = load_rl_config(path, {"kl_coef": 0.05, "steps": 3})
    assert cfg.kl_coef == 0.05 and cfg.steps == 3
    assert cfg.policy_ref == os.path.join(tiny_world, "policy")  # relative to the fixture root
    assert cfg.policy_init == cfg.policy_ref
    with pytest.raises(InputError, match=r"unknown config key 'kl_coeff'.*'kl_coef'"):
        load_rl_config(path, {"kl_coeff": 0.05})
    with pytest.raises(InputError, match=r"samples_per_prompt must be an integer >= 2"):
        load_rl_config(path, {"samples_per_prompt": 1})
    with pytest.raises(InputError, match=r"kl_coef must be a number in \[0, 100\]"):
        load_rl_config(path, {"kl_coef": -1})
    with pytest.raises(InputError, match=r"family_weights: unknown family 'tundra'"):
        load_rl_config(path, {"family_weights": {"tundra": 1}})


def test_grouped_logprobs_equal_the_plain_forward(tiny_world):
    policy = M.load_policy(os.path.join(tiny_world, "policy"))[0]
    prompts = D.prompts_tensor(D.read_jsonl(os.path.join(tiny_world, "data", "prompts_train.jsonl"))[:6])
    responses = rollout.sample(policy, prompts, 5, 1.0, torch.Generator().manual_seed(0))
    rep = prompts.repeat_interleave(5, 0)
    plain, _ = M.token_logprobs(policy, rep, responses)
    grouped, _ = rollout.grouped_logprobs(policy, prompts, responses, 5)
    with torch.no_grad():
        seed_way = torch.log_softmax(policy(torch.cat([rep, responses], 1))[:, V.PROMPT_LEN - 1:-1], -1)
    seed_tok = seed_way.gather(-1, responses[..., None]).squeeze(-1)
    assert torch.allclose(grouped, plain, atol=1e-5)
    assert torch.allclose(plain, seed_tok, atol=1e-5)


def test_a_bfloat16_copy_of_the_reference_scores_close_to_float32(tiny_world):
    """The grouped log-probs of a bfloat16 copy (benchmarks/step_levers.py times one) run with the cached
    float32 causal masks and stay within bfloat16's precision of the float32 model's."""
    policy = M.load_policy(os.path.join(tiny_world, "policy"))[0]
    prompts = D.prompts_tensor(D.read_jsonl(os.path.join(tiny_world, "data", "prompts_train.jsonl"))[:6])
    responses = rollout.sample(policy, prompts, 4, 1.0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        f32 = rollout.grouped_logprobs(policy, prompts, responses, 4)[0]
        b16 = rollout.grouped_logprobs(policy.to(torch.bfloat16), prompts, responses, 4)[0]
    assert b16.dtype == torch.bfloat16
    assert torch.allclose(b16.float(), f32, atol=0.1, rtol=0.05)


def test_table_lookups_equal_the_plain_forwards(tiny_world):
    """The first block as a lookup table (reward model and policy) gives the plain forward's numbers."""
    rm = R.load_rm(os.path.join(tiny_world, "reward_model"))[0]
    policy = M.load_policy(os.path.join(tiny_world, "policy"))[0]
    prompts = D.prompts_tensor(D.read_jsonl(os.path.join(tiny_world, "data", "prompts_train.jsonl"))[:6])
    responses = rollout.sample(policy, prompts, 3, 1.0, torch.Generator().manual_seed(0))
    ids = torch.cat([prompts.repeat_interleave(3, 0), responses], 1)
    with torch.no_grad():
        assert torch.allclose(R.score(rm, ids[:, :V.PROMPT_LEN], ids[:, V.PROMPT_LEN:]), rm(ids), atol=1e-5)
        assert torch.allclose(policy.hidden(ids, table=policy.first_layer_table()), policy.hidden(ids), atol=1e-5)


def test_two_threads_take_the_same_step_as_one(tiny_world):
    """With two torch threads train_rl forks a partner process that samples half of each batch and runs
    the reward model; the steps must equal the one-process steps to float tolerance (same random stream)."""
    cfg = _cfg(tiny_world, steps=2, batch_prompts=6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = train_rl(cfg)
        torch.set_num_threads(2)
        two = train_rl(cfg)
    finally:
        torch.set_num_threads(threads)
    d = one.policy_config["d_model"]
    for (k, a), b in zip(one.policy.state_dict().items(), two.policy.state_dict().values()):
        if k.endswith("attn.qkv.bias"):  # the key bias's gradient is zero up to rounding (softmax is
            a, b = a[torch.arange(3 * d) // d != 1], b[torch.arange(3 * d) // d != 1]  # shift-invariant)
        assert torch.allclose(a, b, atol=1e-6), k
    assert one.history[-1][1]["kl/balanced"] == pytest.approx(two.history[-1][1]["kl/balanced"], abs=1e-5)


def test_a_failing_partner_process_raises_and_leaves_no_process(tiny_world, monkeypatch):
    """An error inside the partner (here its reward model) reaches the caller with the partner's
    traceback instead of a hang, and neither a failure nor a normal end leaves a child process."""
    import multiprocessing

    from rlhf_mlflow.training import two_process_step as partner

    cfg = _cfg(tiny_world, steps=3, batch_prompts=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        train_rl(cfg)
        assert multiprocessing.active_children() == []

        here, real = os.getpid(), R.score

        def broken(*a, **k):  # fails in the partner only
            if os.getpid() != here:
                raise ValueError("reward model exploded")
            return real(*a, **k)
        monkeypatch.setattr(R, "score", broken)  # the forked partner inherits the patch
        with pytest.raises(partner.PartnerFailed, match="reward model exploded"):
            train_rl(cfg)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert multiprocessing.active_children() == []


def test_the_watch_gets_both_cores_while_the_partner_naps(tiny_world):
    """With a partner process this side trains on one thread; an `on_watch` callback runs on the
    thread count the run started with (the partner naps meanwhile), and training gets one back after."""
    cfg = _cfg(tiny_world, steps=4, watch_every=2, watch_gold="data/gold_calib.jsonl", watch_early_every=0)
    seen: list[tuple[int, int]] = []
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        train_rl(cfg, on_watch=lambda step, policy: seen.append((step, torch.get_num_threads())) or "continue",
                 on_log=lambda step, metrics: seen.append((-step, torch.get_num_threads())))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert [s for s in seen if s[0] >= 0] == [(0, 2), (2, 2), (4, 2)]
    assert {n for s, n in seen if s < 0} == {1}  # logging happens on the training side's one thread


def test_an_error_on_the_main_side_stops_the_partner(tiny_world, tmp_path):
    """A reward wrapper that raises (main side, mid-step) ends the run with its error; the partner exits."""
    import multiprocessing

    wrapper = tmp_path / "bad.py"
    wrapper.write_text("def transform(records, tokens, rewards):\n    raise KeyError('nope')\n")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(InputError, match="KeyError"):
            train_rl(_cfg(tiny_world, reward_wrapper=str(wrapper)))
    finally:
        torch.set_num_threads(threads)
    assert multiprocessing.active_children() == []


def _within(counts: torch.Tensor, probs: torch.Tensor, z: float = 4.5) -> bool:
    """Every token's empirical frequency is within z binomial standard errors of its probability."""
    n = float(counts.sum())
    p = probs.double()
    return bool(((counts.double() / n - p).abs() <= z * (p * (1 - p) / n).sqrt() + 1e-9).all())


def test_cached_sampler_draws_from_the_policys_distribution(tiny_world):
    """The first token (prefill path) and the second given the first (cached decode path) against the
    full forward's probabilities."""
    policy = M.load_policy(os.path.join(tiny_world, "policy"))[0]
    prompt = D.prompts_tensor(D.read_jsonl(os.path.join(tiny_world, "data", "prompts_train.jsonl"))[:1])
    resp = rollout.sample(policy, prompt, 6000, 1.0, torch.Generator().manual_seed(1))
    with torch.no_grad():
        p0 = torch.softmax(policy(prompt)[0, -1], -1)[V.CONTENT_LO:V.CONTENT_HI]
        first = torch.bincount(resp[:, 0] - V.CONTENT_LO, minlength=V.N_CONTENT)
        assert _within(first, p0)
        t0 = int(first.argmax()) + V.CONTENT_LO
        ctx = torch.cat([prompt, torch.tensor([[t0]])], 1)
        p1 = torch.softmax(policy(ctx)[0, -1], -1)[V.CONTENT_LO:V.CONTENT_HI]
    second = torch.bincount(resp[resp[:, 0] == t0, 1] - V.CONTENT_LO, minlength=V.N_CONTENT)
    assert second.sum() > 300
    assert _within(second, p1)
    assert not _within(second, torch.full((V.N_CONTENT,), 1 / V.N_CONTENT))  # the check has power


def test_the_samplers_log_probs_are_the_policys_and_leave_the_draws_alone(tiny_world):
    """sample(..., logprobs=[]) returns the same responses and each one's log pi(y|x), to float
    tolerance (certify and the watch use them instead of a forward pass); tempered, the tempered ones."""
    policy = M.load_policy(os.path.join(tiny_world, "policy"))[0]
    prompts = D.prompts_tensor(D.read_jsonl(os.path.join(tiny_world, "data", "prompts_train.jsonl"))[:40])
    lp: list = []
    ys = rollout.sample(policy, prompts, 3, 1.0, torch.Generator().manual_seed(2), lp)
    assert torch.equal(ys, rollout.sample(policy, prompts, 3, 1.0, torch.Generator().manual_seed(2)))
    full = M.sequence_logprobs(policy, prompts.repeat_interleave(3, 0), ys)
    assert torch.allclose(lp[0], full, atol=1e-4) and full.std() > 0.5
    hot: list = []
    hot_ys = rollout.sample(policy, prompts, 3, 2.0, torch.Generator().manual_seed(2), hot)
    assert (hot[0] - M.sequence_logprobs(policy, prompts.repeat_interleave(3, 0), hot_ys)).abs().mean() > 0.5


def test_run_config_round_trips_as_json(tiny_world, tmp_path):
    from dataclasses import asdict
    cfg = load_rl_config(os.path.join(tiny_world, "configs", "default.json"))
    path = tmp_path / "run_config.json"
    path.write_text(json.dumps(asdict(cfg)))
    assert load_rl_config(str(path)) == cfg


def _seed_loop():
    """benchmarks/seed_loop.py (the seed-faithful loop), loaded by path: benchmarks/ is not a package here."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "seed_loop.py")
    spec = importlib.util.spec_from_file_location("seed_loop", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _per_step(history: list[dict], name: str) -> list[dict[str, float]]:
    """The seed loop's per-sample history -> per step, the mean of `name` per family."""
    out = []
    for h in history:
        by: dict[str, list[float]] = {}
        for v, f in zip(h[name], h["family"]):
            by.setdefault(f, []).append(v)
        out.append({f: sum(vs) / len(vs) for f, vs in by.items()})
    return out


def _z(a: list[float], b: list[float], paired: bool) -> float:
    """|mean(a) - mean(b)| in standard errors (of the paired differences, or of two independent means)."""
    import statistics as st
    if paired:
        d = [x - y for x, y in zip(a, b)]
        return abs(st.mean(d)) / max(st.stdev(d) / len(d) ** 0.5, 1e-12)
    se = (st.variance(a) / len(a) + st.variance(b) / len(b)) ** 0.5
    return abs(st.mean(a) - st.mean(b)) / max(se, 1e-12)


def _disagreements(ours: list[dict], seed: list[dict], z: float) -> list[str]:
    """Per metric, the balanced mean (paired by step) and each family's mean (steps where the family was
    drawn, unpaired) whose difference exceeds z standard errors."""
    bad = []
    for name in ("proxy", "kl"):
        o_bal = [m[f"{name}/balanced"] for m in ours]
        s_steps = _per_step(seed, name)
        s_bal = [sum(s.values()) / len(s) for s in s_steps]
        if _z(o_bal, s_bal, paired=True) > z:
            bad.append(f"{name}/balanced")
        for f in V.FAMILIES:
            o = [m[f"{name}/{f}"] for m in ours if f"{name}/{f}" in m]
            s = [st[f] for st in s_steps if f in st]
            if len(o) > 2 and len(s) > 2 and _z(o, s, paired=False) > z:
                bad.append(f"{name}/{f}")
    return bad


def test_fast_loop_matches_the_seed_faithful_loop(tiny_world):
    """Same seed and config, 30 steps of B=16 x G=8: ours and benchmarks/seed_loop.py (no cache, separate
    passes, its own RNG use) must give statistically indistinguishable proxy reward and KL.

    Tolerance: the balanced mean, paired by step, and each family's mean over the steps that drew it
    must agree within 4.5 standard errors of their difference (12 comparisons; under the null a
    false alarm is rare). Power: the same check must flag a run of ours with 3x the learning rate.
    """
    cfg = _cfg(tiny_world, steps=30, batch_prompts=16, samples_per_prompt=8)
    ours = [m for _, m in train_rl(cfg).history]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # its larger ops on two OpenMP threads crawl on a busy machine
        seed = _seed_loop().train(cfg)[1]
    finally:
        torch.set_num_threads(threads)
    assert _disagreements(ours, seed, z=4.5) == []
    faster = [m for _, m in train_rl(replace(cfg, lr=3 * cfg.lr)).history]
    assert "kl/balanced" in _disagreements(faster, seed, z=4.5)
