"""The over-optimisation watch: its config keys, the Gao fit, the past-peak rule, and a train_rl run
that logs the watch's names, warns, or stops at the peak and keeps the best checkpoint."""
from __future__ import annotations

import json
import os

import mlflow
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from rlhf_mlflow.cli import cli
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.decisions import watch as W
from rlhf_mlflow.evidence.watch import PolicyWatch
from rlhf_mlflow.training.rl_config import RLConfig


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _train_run():
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.step` = 'train_rl'",
                                output_format="list")
    return run


def test_watch_config_errors_name_the_key_and_the_choices():
    with pytest.raises(InputError, match="watch_every=50 needs watch_gold"):
        RLConfig(watch_every=50)
    with pytest.raises(InputError, match="watch_every must be an integer"):
        RLConfig(watch_every=-1, watch_gold="g.jsonl")
    with pytest.raises(InputError, match="early_stop must be one of off, warn, stop, got 'halt'"):
        RLConfig(early_stop="halt")
    assert RLConfig(watch_every=50, watch_gold="data/gold_calib.jsonl").resolved("/w").watch_gold == \
        "/w/data/gold_calib.jsonl"


def test_gao_fit_recovers_alpha_and_beta_and_its_peak():
    d = np.linspace(0.2, 3.0, 12)
    gain = d * (0.3 - 0.2 * np.log(d))
    fit = W.gao_fit(d, gain, np.full_like(d, 0.01))
    assert fit["alpha"] == pytest.approx(0.3, abs=1e-9) and fit["beta"] == pytest.approx(0.2, abs=1e-9)
    assert fit["peak_d"] == pytest.approx(np.exp(0.3 / 0.2 - 1)) and fit["peak_kl"] == pytest.approx(fit["peak_d"] ** 2)
    noisy = W.gao_fit(d, gain + np.random.default_rng(0).normal(0, 0.005, len(d)), np.full_like(d, 0.005))
    assert noisy["alpha"] == pytest.approx(0.3, abs=0.02) and noisy["beta"] == pytest.approx(0.2, abs=0.02)
    assert np.allclose(W.gao_curve(fit, d), gain)


def test_gao_fit_reports_no_peak_when_the_gain_never_turns():
    d = np.linspace(0.2, 3.0, 12)
    rising = W.gao_fit(d, 0.1 * d + 0.05 * d * np.log(d), np.full_like(d, 0.01))  # beta = -0.05
    assert rising["beta"] < 0 and rising["peak_d"] is None and rising["peak_kl"] is None
    assert W.gao_fit([0.0, 0.5], [0.0, 0.1], [0.01, 0.01])["alpha"] is None  # one point with d > 0: no fit


def test_the_best_of_n_form_recovers_alpha_beta_and_its_peak():
    from rlhf_mlflow.decisions import bon_watch as BW
    d = np.sqrt([BW.bon_kl(n) for n in BW.ladder(256)[1:]])
    gain = d * (0.4 - 0.25 * d)
    fit = W.gao_fit(d, gain, np.full_like(d, 0.01), "bon")
    assert fit["alpha"] == pytest.approx(0.4, abs=1e-9) and fit["beta"] == pytest.approx(0.25, abs=1e-9)
    assert fit["peak_d"] == pytest.approx(0.8) and fit["peak_kl"] == pytest.approx(0.64)
    assert np.allclose(W.gao_curve(fit, d), gain)
    assert W.gao_fit(d, gain, np.full_like(d, 0.01))["form"] == "rl"  # the RL form is the default
    assert BW.ladder(32) == [1, 2, 4, 8, 16, 32] and BW.ladder(5) == [1, 2, 4, 5] and BW.ladder(1) == [1]
    assert BW.bon_kl(1) == 0 and BW.bon_kl(2) == pytest.approx(np.log(2) - 0.5)


def test_bon_with_an_expert_set_logs_the_curve_on_the_n_axis_and_its_fit(tiny_world):
    """`bon --watch-gold`: the watch's estimate of best-of-n's true quality at n = 1, 2, 4, 8 on the
    step axis, the fit at the last n, the figure. At n = 1 best-of-n is the policy itself (here the
    expert set's reference), so the estimate must sit on the expert labels' mean within its noise."""
    w = os.path.join(tiny_world, "")
    res = _run("bon", "--policy", w + "policy", "--reward-model", w + "reward_model", "--prompts",
               w + "data/prompts_dev.jsonl", "--n", 8, "--limit", 10, "--watch-gold", w + "data/gold_calib.jsonl")
    assert res.exit_code == 0, res.output
    (run,) = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`rlhf.step` = 'bon'",
                                output_format="list")
    client = mlflow.MlflowClient()
    gold = D.read_jsonl(w + "data/gold_calib.jsonl", labelled=True)
    for f, rows in D.group_by_family(gold).items():
        hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"bon/watch/{f}")}
        se = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"bon/watch/se/{f}")}
        assert sorted(hist) == [1, 2, 4, 8], f
        assert abs(hist[1] - np.mean([r["label"] for r in rows])) < 4 * se[1] + 0.01, f
    assert not any("gao_" in k for k in run.data.metrics)  # the fit is a table, not single-point charts
    assert "bon_gao_fits.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert all(f in run.data.tags["rlhf.bon.peaks"] for f in V.FAMILIES)
    assert "figures/bon_gao_fits.png" in [a.path for a in client.list_artifacts(run.info.run_id, "figures")]
    res = _run("bon", "--policy", w + "policy", "--reward-model", w + "reward_model", "--prompts",
               w + "data/prompts_dev.jsonl", "--watch-correction", "c.py")
    assert res.exit_code != 0 and "--watch-correction needs --watch-gold" in res.output


def _point(step, values: dict[str, float], noise: float = 0.01) -> W.WatchPoint:
    """A synthetic watch point: every point's draws share the same noise (paired, as the watch's are)."""
    z = np.random.default_rng(0).normal(0, 1, 200)
    fams = {**values, "balanced": float(np.mean(list(values.values())))}
    return W.WatchPoint(step, dict(fams), {f: noise for f in fams}, {f: v + noise * z for f, v in fams.items()},
                        {f: step / 100 for f in fams}, dict(fams), {f: "doubly_robust" for f in values})


@pytest.fixture
def watch(tiny_world):
    w = os.path.join(tiny_world, "")
    gold = D.read_jsonl(w + "data/gold_calib.jsonl", labelled=True)
    return PolicyWatch(M.load_policy(w + "policy")[0], R.load_rm(w + "reward_model")[0], None, gold)


def test_the_rule_fires_on_a_real_drop_once_and_not_on_a_flat_or_rising_family(watch):
    fams = list(watch.families)
    other = {f: 0.3 for f in fams[1:]}
    for step, first in ((0, 0.30), (10, 0.36), (20, 0.35), (30, 0.30), (40, 0.20)):
        pt = watch.add(_point(step, {fams[0]: first, **other}))
        assert pt.alarms == ([fams[0]] if step == 30 else [])  # 0.01 below the best is noise; 0.06 is not
    assert watch.fired == {fams[0]: 30}
    assert watch.best_step() == 10


def test_the_best_point_is_vouched_for_and_the_proposal_need_not_be():
    """A point far from the reference whose estimates the expert set cannot vouch for, with the higher
    estimate, is not the watch's best point; it is its proposal (for a caller that buys labels)."""
    near, far = _point(10, {"anvil": 0.35, "birch": 0.35}), _point(20, {"anvil": 0.45, "birch": 0.45})
    far.vouched = {"anvil": False, "birch": True, "balanced": False}
    points = [_point(0, {"anvil": 0.3, "birch": 0.3}), near, far]
    assert W.best_step(points) == 10 and W.best_step(points, vouched_only=False) == 20
    assert W.best_step([_point(0, {"anvil": 0.3, "birch": 0.3})]) is None  # the reference is no candidate
    assert W.best_step([points[0], far]) is None  # no trained point vouched for: says there is none


def _with_shortcut(pt: W.WatchPoint, family: str, rise: float, se: float = 0.1) -> W.WatchPoint:
    pt.shortcuts[family] = {"rule": "pa", "reference_count": 0.2, "policy_count": 0.2 + rise, "rise": rise, "se": se}
    return pt


def test_a_flagged_shortcut_taking_over_fires_before_the_estimate_falls(watch):
    """The second rule: a shortcut's count per answer above the reference's by more than the gate's
    marker_collapse bound (0.5) and by z ses fires, with the estimate still flat; a smaller or a noisy
    rise does not."""
    fams = list(watch.families)
    flat = {f: 0.3 for f in fams}
    assert watch.add(_with_shortcut(_point(0, flat), fams[0], 0.0)).alarms == []
    assert watch.add(_with_shortcut(_point(10, flat), fams[0], 0.45)).alarms == []        # under the bound
    assert watch.add(_with_shortcut(_point(20, flat), fams[0], 0.6, se=0.4)).alarms == []  # within noise
    pt = watch.add(_with_shortcut(_point(30, flat), fams[0], 0.9))
    assert pt.alarms == [fams[0]] and watch.fired == {fams[0]: 30}
    assert watch.why == {fams[0]: "shortcut pa 0.20 -> 1.10 per answer"}
    assert watch.metrics(pt)[f"shortcut_rise/{fams[0]}"] == pytest.approx(0.9)


def test_the_watch_counts_the_corrections_shortcuts_under_the_reference_and_the_policy(tiny_world, tmp_path):
    """With a correction file's RULES the watch counts its shortcuts: the reference against itself
    has no rise beyond noise, and the reference counts are drawn once, not at every point."""
    from rlhf_mlflow.core.reward_wrapper import load_wrapper
    path = tmp_path / "correction.py"
    path.write_text("from rlhf_mlflow.decisions.correction import apply_rules\n"
                    "RULES = [{'family': 'dune', 'kind': 'token', 'token': 'pa', 'bonus': 1.4, 'se': 0.02}]\n"
                    "def transform(records, response_tokens, rewards):\n"
                    "    return apply_rules(RULES, records, response_tokens, rewards)\n")
    wrapper = load_wrapper(str(path))
    assert wrapper.rules == ({"family": "dune", "kind": "token", "token": "pa", "bonus": 1.4},)
    w = os.path.join(tiny_world, "")
    gold = D.read_jsonl(w + "data/gold_calib.jsonl", labelled=True)
    reference = M.load_policy(w + "policy")[0]
    watch = PolicyWatch(reference, R.load_rm(w + "reward_model")[0], wrapper, gold)
    pt = watch.observe(0, reference)
    assert set(pt.shortcuts) == {"dune"}
    s = pt.shortcuts["dune"]
    assert s["reference_count"] > 0 and abs(s["rise"]) < 4 * s["se"] + 0.05 and pt.alarms == []
    assert watch.fixed["dune"]["shortcuts"][0]["reference_count"] == s["reference_count"]


def test_load_wrapper_refuses_rules_outside_the_schema(tmp_path):
    from rlhf_mlflow.core.reward_wrapper import load_wrapper
    path = tmp_path / "bad.py"
    path.write_text("RULES = [{'family': 'dune', 'kind': 'word', 'token': 'pa'}]\n"
                    "def transform(records, response_tokens, rewards):\n    return rewards\n")
    with pytest.raises(InputError, match=r"bad.py: RULES\[0\]: unknown kind 'word'; valid kinds are"):
        load_wrapper(str(path))


def test_the_watch_looks_densely_before_its_first_regular_point():
    cfg = RLConfig(watch_every=50, watch_gold="g.jsonl")
    assert [s for s in range(0, 161) if cfg.watch_due(s)] == [0, 20, 40, 50, 100, 150]
    sparse = RLConfig(watch_every=50, watch_early_every=0, watch_gold="g.jsonl")
    assert [s for s in range(0, 161) if sparse.watch_due(s)] == [0, 50, 100, 150]
    assert not any(RLConfig().watch_due(s) for s in range(0, 100))
    with pytest.raises(InputError, match="watch_early_every must be an integer"):
        RLConfig(watch_every=50, watch_early_every=-5, watch_gold="g.jsonl")


def test_watch_on_the_reference_policy_estimates_every_family(watch, tiny_world):
    pt = watch.observe(0, M.load_policy(os.path.join(tiny_world, "policy"))[0])
    assert set(pt.estimate) == set(watch.families) | {"balanced"}
    assert all(abs(pt.kl[f]) < 1e-6 for f in watch.families)  # the reference against itself
    assert all(0 < pt.se[f] < 0.2 for f in pt.se) and pt.alarms == [] and not pt.best  # the reference: no candidate


def test_a_train_rl_run_with_the_watch_logs_its_names_and_the_fit_figure(tiny_world):
    res = _run("train-rl", "--world", tiny_world, "--steps", 20, "--batch-prompts", 4, "--log-every", 10,
               "--watch-every", 10, "--watch-gold", "data/gold_calib.jsonl", "--no-register")
    assert res.exit_code == 0, res.output
    run = _train_run()
    client = mlflow.MlflowClient()
    for name in ("watch/dune", "watch/balanced", "watch/se/dune", "watch/se/balanced", "watch/past_peak/dune"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [0, 10, 20], name
    # a fit needs two points away from the reference (an estimated KL > 0): only at step 20, where it can
    fits = json.load(open(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="watch_gao_fits.json")))
    rows = [dict(zip(fits["columns"], r)) for r in fits["data"]]
    assert {r["family"] for r in rows} == set(V.FAMILIES) and any(r["alpha"] is not None for r in rows)
    assert all(r["peak"].startswith(("peak at KL", "no peak in range", "no fit")) for r in rows)
    assert all(r["peak"] in run.data.tags["rlhf.watch.peaks"] for r in rows)
    assert not any("gao_" in k for k in run.data.metrics)
    figures = [a.path for a in client.list_artifacts(run.info.run_id, "figures")]
    assert "figures/gao_fits.png" in figures
    assert run.data.params["watch_every"] == "10" and run.data.params["early_stop"] == "warn"
    assert run.data.params["select"] == "final"


def test_stop_ends_the_run_finished_at_the_peak_and_registers_the_best_checkpoint(tiny_world, monkeypatch):
    """A synthetic estimate sequence forces dune past its peak at step 30 of 60."""
    dune = {0: 0.30, 10: 0.34, 20: 0.36, 30: 0.25, 40: 0.2, 50: 0.2, 60: 0.2}

    def estimate(self, step, policy):
        return _point(step, {f: (dune[step] if f == "dune" else 0.3) for f in self.families})
    monkeypatch.setattr(PolicyWatch, "estimate", estimate)
    res = _run("train-rl", "--world", tiny_world, "--steps", 60, "--batch-prompts", 4, "--log-every", 20,
               "--save-every", 20, "--watch-every", 10, "--watch-gold", "data/gold_calib.jsonl", "--early-stop", "stop")
    assert res.exit_code == 0, res.output
    run = _train_run()
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["rlhf.watch.past_peak"] == "dune@30"
    assert tags["rlhf.watch.stopped"].startswith("step 30: dune past its peak")
    assert tags["rlhf.watch.best_step"] == "20" and tags["rlhf.registered_step"] == "20"
    # chosen on the expert set's estimates, as the run's (immutable) parameters say: certify will not reuse it
    assert run.data.params["select"] == "watch_best"
    from rlhf_mlflow.core.checkpoint import content_sha256
    from rlhf_mlflow.steps.selection import chosen_on
    assert chosen_on("1")["expert_set_sha256"] == content_sha256(os.path.join(tiny_world, "data", "gold_calib.jsonl"))
    client = mlflow.MlflowClient()
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "train/proxy/balanced")) == 30
    assert "checkpoints/watch_best" in [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    version = client.get_model_version("rlhf-policy", "1")
    assert version.tags["checkpoint_step"] == "20"
    # the best step's checkpoint carries the watch's state for a resume; the registered model does not
    assert {"watch_state.json", "watch_best"} <= set(a.path.split("/")[-1] for a in
                                                     client.list_artifacts(run.info.run_id, "checkpoints/step_20"))
    from rlhf_mlflow.tracking.policy_model import resolve_policy
    registered = os.listdir(resolve_policy("models:/rlhf-policy/1")[0])
    assert "policy.safetensors" in registered and not {"watch_state.json", "watch_best"} & set(registered)


def test_the_watch_does_not_change_what_training_learns(watch, tiny_world):
    """The watch samples with its own generator and no gradient: the same policy with it as without."""
    from rlhf_mlflow.training.train_rl import train_rl
    cfg = RLConfig(steps=4, batch_prompts=4, samples_per_prompt=2, log_every=2).resolved(tiny_world)
    plain = train_rl(cfg).policy.state_dict()
    watched_cfg = RLConfig(steps=4, batch_prompts=4, samples_per_prompt=2, log_every=2, watch_every=2,
                           watch_gold="data/gold_calib.jsonl").resolved(tiny_world)
    watched = train_rl(watched_cfg, on_watch=lambda step, policy: watch.observe(step, policy) and "continue")
    assert [p.step for p in watch.points] == [0, 2, 4]
    assert all(torch.equal(plain[k], watched.policy.state_dict()[k]) for k in plain)


def test_evidence_of_all_families_at_once_is_each_familys_own(tiny_world):
    """families_evidence runs each model once over every family's rows (the watch's speed); each
    family's slice must be what family_evidence gives it alone. Near-greedy sampling (temperature
    1e-6) makes the samples independent of the random stream, so the two agree to float tolerance."""
    from rlhf_mlflow.decisions import certify as C
    from rlhf_mlflow.evidence import certify_evidence as E
    w = os.path.join(tiny_world, "")
    gold = D.read_jsonl(w + "data/gold_calib.jsonl", labelled=True)
    reference, rm = M.load_policy(w + "policy")[0], R.load_rm(w + "reward_model")[0]
    policy = M.load_policy(w + "policy")[0]
    with torch.no_grad():  # a policy that differs from the reference: nonzero log-ratios and KL
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    by_family = D.group_by_family(gold)
    assert len(by_family) > 1
    cfg = C.CertifyConfig(samples_per_prompt=2, temperature=1e-6)
    fixed = {f: E.fixed_evidence(reference, rm, None, rows) for f, rows in by_family.items()}
    together = E.families_evidence(policy, reference, rm, None, by_family, cfg, torch.Generator().manual_seed(3),
                                   fixed)
    assert list(together) == list(by_family)
    for f, rows in by_family.items():
        alone = E.family_evidence(policy, reference, rm, None, rows, cfg, [], torch.Generator().manual_seed(4),
                                  fixed[f])
        for k in ("log_ratios", "labels", "scores", "policy_scores_all", "policy_scores"):
            np.testing.assert_allclose(together[f][k], alone[k], atol=1e-5, err_msg=f"{f} {k}")
        assert together[f]["kl"] == pytest.approx(alone["kl"], abs=1e-5) and abs(alone["kl"]) > 1e-4
        assert together[f]["pop_ess"] == pytest.approx(alone["pop_ess"], rel=1e-4)


def _blind(pt: W.WatchPoint, family: str, proxy: float, vouched: bool = False) -> W.WatchPoint:
    """The point with `family`'s overlap gone (or kept) and its proxy reward at `proxy` (se 0.01)."""
    pt.vouched = {f: True for f in pt.estimate if f != "balanced"} | {family: vouched}
    pt.vouched["balanced"] = all(v for f, v in pt.vouched.items() if f != "balanced")
    pt.reason = {f: "ok" if v else "population ESS 3.0 < 10 of 30" for f, v in pt.vouched.items()}
    pt.proxy = {family: proxy, f"se/{family}": 0.01}
    return pt


def test_where_overlap_is_gone_the_watch_charts_no_quality_and_fits_compares_and_chooses_none(watch):
    """Issue 33: an estimate the expert set cannot vouch for is no quality: not logged under watch/<family>
    (nor balanced), only `vouched/<family>` 0; not fitted, not compared by the past-peak rule, and no
    point with such a family is the best checkpoint."""
    fams = list(watch.families)
    hacked, rest = fams[0], {f: 0.3 for f in fams[1:]}
    watch.add(_blind(_point(0, {hacked: 0.30, **rest}), hacked, 1.0, vouched=True))
    watch.add(_blind(_point(10, {hacked: 0.32, **rest}), hacked, 1.0, vouched=True))
    pt = watch.add(_blind(_point(20, {hacked: 0.90, **rest}), hacked, 1.0))  # what the reward model believes
    m = watch.metrics(pt)
    assert hacked not in m and "balanced" not in m and f"se/{hacked}" not in m
    assert m[f"vouched/{hacked}"] == 0.0 and m[f"vouched/{fams[1]}"] == 1.0 and fams[1] in m
    assert watch.best_step() == 10  # not step 20, whose balanced estimate is the highest
    assert watch.fits()[hacked]["alpha"] is None  # one vouched point away from the reference: no fit
    # a vouched point below the unvouched 0.90 is no drop from it
    assert hacked not in watch.add(_blind(_point(30, {hacked: 0.31, **rest}), hacked, 1.0, vouched=True)).alarms


def test_overlap_lost_while_the_reward_rises_is_an_alarm_when_asked_and_a_flat_reward_is_not(watch):
    fams = list(watch.families)
    flat = {f: 0.3 for f in fams}
    watch.add(_blind(_point(0, flat), fams[0], 1.0, vouched=True))
    assert watch.add(_blind(_point(10, flat), fams[0], 1.01)).alarms == []       # overlap gone, reward flat
    assert watch.add(_blind(_point(20, flat), fams[0], 1.5)).alarms == []        # off by default: measured
    watch.cfg = W.WatchConfig(overlap_alarm=True)                                # false alarms (docs/WATCH.md)
    pt = watch.add(_blind(_point(30, flat), fams[0], 1.6))                       # ... and the reward rising
    assert pt.alarms == [fams[0]] and watch.fired == {fams[0]: 30}
    assert watch.why[fams[0]] == "overlap lost (population ESS 3.0 < 10 of 30) while its reward rose"
    assert watch.best_step() == 0 or watch.best_step() is None


def test_an_uncorrected_run_logs_no_quality_for_a_hacked_family_once_its_overlap_is_gone(tiny_world):
    """The test-scale world pays dune's `pa` and ember's `he`; trained on that reward with the watch alone
    (no correction), the policy leaves the expert set's support there: from then on the watch logs
    `vouched/<family>` 0 and no `watch/<family>` (nor `watch/balanced`) at that step."""
    res = _run("train-rl", "--world", tiny_world, "--steps", 60, "--batch-prompts", 8, "--log-every", 10,
               "--watch-every", 10, "--watch-gold", "data/gold_calib.jsonl", "--no-register")
    assert res.exit_code == 0, res.output
    run, client = _train_run(), mlflow.MlflowClient()

    def history(name):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
    blind = {}
    for f in V.FAMILIES:
        vouched, estimate = history(f"watch/vouched/{f}"), history(f"watch/{f}")
        assert sorted(vouched) == list(range(0, 61, 10)), f
        blind[f] = [s for s, v in vouched.items() if v == 0.0]
        assert not set(blind[f]) & set(estimate), f  # no quality where the expert set cannot vouch
        assert set(estimate) == set(vouched) - set(blind[f]), f
    assert blind["dune"] or blind["ember"], blind  # a planted shortcut took the policy out of reach
    assert not set().union(*blind.values()) & set(history("watch/balanced"))
    assert "rlhf.watch.unvouched" in run.data.tags
