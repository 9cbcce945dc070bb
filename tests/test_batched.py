"""Batched runs: n policies trained in one process through one stacked step give each member what
training it alone gives (to float tolerance), and a member's checkpoint resumes like a single run's."""
from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest
import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core.stacked_policy import StackedPolicy
from rlhf_mlflow.training.batch_run import run_all, run_together
from rlhf_mlflow.training.batched import Batch
from rlhf_mlflow.training.rl_config import RLConfig
from rlhf_mlflow.training.stacked_adam import MemberOptimizer, StackedAdam, clip_per_member
from rlhf_mlflow.training.train_rl import Resume, train_rl
from rlhf_mlflow.training.train_state import capture


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a single run then has no partner process: the plainest comparison
    yield
    torch.set_num_threads(before)


def _policies(n):
    torch.manual_seed(0)
    return [M.Policy(M.default_config()) for _ in range(n)]


def test_the_stacked_policy_samples_and_scores_as_each_member_alone():
    policies = _policies(3)
    stack = StackedPolicy(policies)
    B, G, L = 4, 3, M.default_config()["resp_len"]
    prompts = torch.randint(0, 10, (3 * B, M.default_config()["prompt_len"]))
    uniforms = rollout.draw_uniforms(L, 3 * B * G, torch.Generator().manual_seed(1))
    table = stack.first_layer_table()
    responses = rollout.sample_cached(stack, prompts, G, 1.0, None, table, uniforms)
    logprobs, _ = rollout.grouped_logprobs(stack, prompts, responses, G, table)
    grads = torch.autograd.grad(logprobs.sum(), stack.stacked_parameters())
    for m, policy in enumerate(policies):
        rows, seqs = slice(m * B, (m + 1) * B), slice(m * B * G, (m + 1) * B * G)
        assert torch.equal(rollout.sample_cached(policy, prompts[rows], G, 1.0, None, uniforms=uniforms[:, seqs]),
                           responses[seqs])
        alone, _ = rollout.grouped_logprobs(policy, prompts[rows], responses[seqs], G)
        torch.testing.assert_close(alone, logprobs[seqs], atol=1e-5, rtol=0)
        for g, stacked, t in zip(torch.autograd.grad(alone.sum(), list(policy.parameters())), grads,
                                 stack.transposed()):
            torch.testing.assert_close(g, stacked[m].t() if t else stacked[m], atol=1e-5, rtol=1e-4)


def test_stacked_adam_is_torchs_adam_per_member_and_its_state_moves_both_ways():
    torch.manual_seed(0)
    shapes, lrs, max_norms = [(5, 4), (7,)], [1e-3, 3e-3, 5e-4], [1.0, 0.1, 10.0]
    stacked = [torch.randn(3, *s) for s in shapes]
    alone = [[p[m].clone().requires_grad_() for p in stacked] for m in range(3)]
    opts = [torch.optim.Adam(ps, lr=lr, fused=True) for ps, lr in zip(alone, lrs)]
    adam = StackedAdam(stacked, lrs)
    for k in range(6):
        grads = [torch.randn(3, *s) * 10.0 ** (1 - k) for s in shapes]  # clipped at first, then not
        for m in range(3):
            for p, g in zip(alone[m], grads):
                p.grad = g[m].clone()
            torch.nn.utils.clip_grad_norm_(alone[m], max_norms[m], foreach=True)
            opts[m].step()
        clip_per_member(grads, torch.tensor(max_norms))
        adam.step(grads)
    for m in range(3):
        for p, q in zip(alone[m], stacked):
            torch.testing.assert_close(p.detach(), q[m], atol=1e-6, rtol=1e-5)
    member = MemberOptimizer(lambda: adam, lambda: 1, opts[1].state_dict()["param_groups"], [False, False])
    fresh = torch.optim.Adam([p.detach().clone().requires_grad_() for p in alone[1]], lr=lrs[1], fused=True)
    fresh.load_state_dict(member.state_dict())  # a member's state resumes a single run ...
    torch.testing.assert_close(fresh.state_dict()["state"][0]["exp_avg"], adam.exp_avg[0][1])
    member.load_state_dict(opts[0].state_dict())  # ... and a single run's resumes a member
    assert torch.equal(adam.exp_avg_sq[1][1], opts[0].state_dict()["state"][1]["exp_avg_sq"])
    with pytest.raises(ValueError):
        member.load_state_dict({"state": {0: opts[0].state_dict()["state"][0]},
                                "param_groups": opts[0].state_dict()["param_groups"]})


def _recipes(world):
    base = RLConfig(steps=6, batch_prompts=4, samples_per_prompt=4, log_every=2, save_every=3).resolved(world)
    return [replace(base, kl_coef=0.05, seed=1),
            replace(base, kl_coef=0.3, seed=2, lr=6e-4, steps=4, family_weights={"dune": 1.0, "anvil": 2.0}),
            replace(base, kl_coef=0.1, seed=3, steps=8, max_grad_norm=0.5)]


def _halve(records, tokens, raw):
    return [r / 2 for r in raw]


def _outputs(policy, world):
    """The policy's per-token log-probs on a fixed batch: what the weights do, which is what must agree
    (the attention key biases, whose gradient is zero up to rounding, take Adam steps of rounding noise)."""
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, 10, (6, M.default_config()["prompt_len"]), generator=g)
    responses = rollout.sample_cached(M.load_policy(os.path.join(world, "policy"))[0], prompts, 2, 1.0, g)
    return rollout.grouped_logprobs(policy, prompts, responses, 2)[0].detach()


def _same(a, b, world):
    assert [s for s, _ in a.history] == [s for s, _ in b.history]
    for (_, x), (_, y) in zip(a.history, b.history):
        assert x.keys() == y.keys()
        for k in x:
            if k != "steps_per_s":
                assert x[k] == pytest.approx(y[k], abs=1e-4), k
    torch.testing.assert_close(_outputs(a.policy, world), _outputs(b.policy, world), atol=1e-4, rtol=0)


def test_each_member_of_a_batch_trains_as_it_would_alone(tiny_world):
    cfgs = _recipes(tiny_world)
    wrappers = [None, _halve, None]
    alone = [train_rl(c, wrapper=w) for c, w in zip(cfgs, wrappers)]
    together = run_together([lambda seat, c=c, w=w: train_rl(c, wrapper=w, seat=seat) for c, w in zip(cfgs, wrappers)])
    for a, b in zip(alone, together):
        assert not isinstance(b, BaseException), b
        _same(a, b, tiny_world)
    assert not any(p.requires_grad or p._base is not None for b in together for p in b.policy.parameters())


def test_a_members_checkpoint_resumes_alone_as_if_it_had_never_stopped(tiny_world, tmp_path):
    cfgs = _recipes(tiny_world)
    saved = {}

    def keep(k):
        def on_checkpoint(step, policy, state):
            path = str(tmp_path / f"m{k}-{step}")
            M.save_policy(policy, policy.cfg, path)
            saved[k] = Resume(path, state)
        return on_checkpoint
    together = run_together([lambda seat, k=k: train_rl(cfgs[k], seat=seat, on_checkpoint=keep(k)) for k in range(3)])
    for k in (0, 2):  # stopped at step 3 (a kill after that checkpoint): resumed alone
        assert saved[k].state.step in (3, 6)
        resumed = train_rl(cfgs[k], resume=saved[k])
        _same(together[k], resumed, tiny_world)


def test_a_seat_released_before_joining_and_a_failing_member_hold_nobody_up(tiny_world):
    cfgs = _recipes(tiny_world)

    def fails_early(seat):
        raise RuntimeError("bad input before training")
    out = run_together([fails_early, lambda seat: train_rl(cfgs[0], seat=seat),
                        lambda seat: train_rl(replace(cfgs[1], samples_per_prompt=2), seat=seat)])
    assert isinstance(out[0], RuntimeError)
    assert "must share samples_per_prompt" in str(out[2]) or "must share samples_per_prompt" in str(out[1])
    done = [r for r in out[1:] if not isinstance(r, BaseException)]
    assert len(done) == 1 and done[0].history[-1][0] in (cfgs[0].steps, cfgs[1].steps)


def test_run_all_returns_every_result_or_raises_the_first_failure_once_all_have_finished():
    """What main's batched groups and the benchmarks' batched arms rely on: a failed member fails the
    whole, but only after the others have run to their end (their MLflow runs close normally)."""
    finished = threading.Event()

    def ok(value, wait=0.0):
        def call(seat):
            threading.Event().wait(wait)
            if wait:
                finished.set()
            return value
        return call

    def bad(message):
        def call(seat):
            raise ValueError(message)
        return call
    assert run_all([ok(1), ok(2)]) == [1, 2]
    with pytest.raises(ValueError, match="^first$"):
        run_all([bad("first"), ok(3, wait=0.3), bad("second")])
    assert finished.is_set()


def test_frozen_models_that_do_not_load_fail_every_member_and_hang_none(tiny_world, tmp_path):
    from rlhf_mlflow.core.errors import InputError
    cfgs = [replace(c, reward_model=str(tmp_path / "no_such_rm")) for c in _recipes(tiny_world)]
    out = run_together([lambda seat, c=c: train_rl(c, seat=seat) for c in cfgs])
    assert all(isinstance(r, InputError) for r in out), out


def test_an_abort_reaches_every_waiting_member(tiny_world):
    cfg = replace(_recipes(tiny_world)[0], steps=10_000)
    batch, errors, started = Batch(2), [], threading.Event()

    def member(seat):
        try:
            train_rl(cfg, seat=seat, on_log=lambda *a: started.set())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            seat.release()
    threads = [threading.Thread(target=member, args=(s,)) for s in batch.seats()]
    for t in threads:
        t.start()
    assert started.wait(60)
    batch.abort(KeyboardInterrupt("signal 15"))
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all(isinstance(e, KeyboardInterrupt) for e in errors)


BATCH_SCRIPT = """
import sys
from rlhf_mlflow.core.process import handle_signals
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.train_rl import run_train_rl
from rlhf_mlflow.training.batch_run import run_all, run_together
from rlhf_mlflow.training.rl_config import load_rl_config
handle_signals()
world, out = WorldPaths.at(sys.argv[1]), sys.argv[2]
recipes = {recipes!r}
run_together([lambda seat, i=i, ov=ov: run_train_rl(load_rl_config(world.config, ov), world=world, out=f"{{out}}/m{{i}}",
                                                     run_name=f"m{{i}}", register=False, progress=False, seat=seat)
              for i, ov in enumerate(recipes)])
"""
KILL_RECIPES = [dict(steps=60, save_every=10, log_every=1, batch_prompts=8, samples_per_prompt=4, kl_coef=k, seed=s)
                for k, s in ((0.05, 1), (0.2, 2))]


@pytest.mark.slow  # ~60 s: a real process killed mid-way, then two resumes
def test_a_batch_killed_mid_way_resumes_each_member_like_a_single_run(tiny_world, tmp_path, tracking_uri):
    import signal
    import subprocess
    import sys
    import time

    import mlflow

    from rlhf_mlflow.core.world_paths import WorldPaths
    from rlhf_mlflow.steps.train_rl import run_train_rl
    from rlhf_mlflow.training.rl_config import load_rl_config
    world = WorldPaths.at(tiny_world)
    for i, ov in enumerate(KILL_RECIPES):  # each alone, uninterrupted
        run_train_rl(load_rl_config(world.config, ov), world=world, run_name=f"alone{i}", register=False, progress=False)
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "RLHF_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", BATCH_SCRIPT.format(recipes=KILL_RECIPES), tiny_world,
                             str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not all(os.path.isdir(tmp_path / f"m{i}" / "step_20") for i in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    rlhf = os.path.join(os.path.dirname(sys.executable), "rlhf-mlflow")
    client = mlflow.MlflowClient()
    for i in range(2):
        (run,) = mlflow.search_runs(search_all_experiments=True, filter_string=f"attributes.run_name = 'm{i}'",
                                    output_format="list")
        assert run.info.status == "RUNNING"
        res = subprocess.run([rlhf, "train-rl", "--resume", run.info.run_id, "--no-register"], env=env,
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert mlflow.get_run(run.info.run_id).info.status == "FINISHED"
        (alone,) = mlflow.search_runs(search_all_experiments=True, filter_string=f"attributes.run_name = 'alone{i}'",
                                      output_format="list")
        for key in ("train/proxy/balanced", "train/kl/balanced", "train/stats/loss"):
            ours, theirs = (sorted((m.step, m.value) for m in client.get_metric_history(r, key))
                            for r in (run.info.run_id, alone.info.run_id))
            assert [s for s, _ in ours] == list(range(1, 61)) == [s for s, _ in theirs], key
            assert all(abs(a - b) < 1e-4 * max(1.0, abs(b)) for (_, a), (_, b) in zip(ours, theirs)), key


def test_a_bad_batch_setting_is_one_error_line_before_main_starts_a_run(tiny_world, tmp_path, monkeypatch):
    import mlflow
    from click.testing import CliRunner

    from rlhf_mlflow.cli import cli
    monkeypatch.setenv("RLHF_BATCH_RUNS", "two")
    res = CliRunner().invoke(cli, ["main", "--world", tiny_world, "--steps-scale", "0.05", "--out", str(tmp_path / "out")])
    assert res.exit_code == 1 and "RLHF_BATCH_RUNS='two': expected a positive integer" in res.output, res.output
    assert "Traceback" not in res.output
    assert mlflow.search_runs(search_all_experiments=True).empty
