"""Certification from expert labels on the policy's own samples: the PPI maths by hand, its coverage
by simulation, and label-requests -> expert-label -> certify -> release on a real store, with every
kind of bad labels file refused (run FAILED, version untagged)."""
from __future__ import annotations

import hashlib
import json
import os

import mlflow
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import copy_store, store_made_once
from test_certify import sharpened

from rlhf_mlflow.cli import cli
from rlhf_mlflow.cli.portable import certify_main, label_requests_main
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.decisions.labelled import gain_se, half_width, ppi_mean, skew_shift, t_quantile
from rlhf_mlflow.evidence.certify import certify
from rlhf_mlflow.evidence.label_requests import draw_requests
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.policy_model import REGISTERED_MODEL, log_policy
from rlhf_mlflow.world.annotator import label_requests
from rlhf_mlflow.world.oracle import Oracle

LENIENT = "min_balanced_gain=-1,require_significant_gain=false,min_family_change=-1,max_family_kl=100,waive=marker_collapse"


def test_ppi_by_hand():
    fu, fl, y = np.array([0.0, 1.0, 0.0, 1.0]), np.array([0.0, 1.0]), np.array([0.5, 1.0])
    est = ppi_mean(fu, fl, y)
    # four prompts, one sample each: var_u = var(f_u) / 4 = 1/12; var(f) over all 6 = 0.3; cov(y, f_l) = 0.25;
    # lambda = 0.25 / (0.3 + 2 * 1/12) = 15/28
    assert est.lam == pytest.approx(15 / 28)
    assert est.estimate == pytest.approx(15 / 28 * 0.5 + (0.75 - 15 / 28 * 0.5))
    resid = y - 15 / 28 * fl
    assert est.se == pytest.approx(np.sqrt((15 / 28) ** 2 / 12 + np.var(resid, ddof=1) / 2))
    flat = ppi_mean(np.ones(10), np.ones(3), np.array([0.0, 0.5, 1.0]))  # a constant predictor: the labels' mean
    assert flat.lam == 0.0 and flat.estimate == pytest.approx(0.5)
    # two samples on each of two prompts: the unlabelled variance is the prompt means' (0 and 1)
    two = ppi_mean(np.array([[0.0, 0.0], [1.0, 1.0]]), fl, y)
    assert two.N == 4 and two.se == pytest.approx(np.sqrt(two.lam ** 2 * 0.5 / 2 + np.var(y - two.lam * fl, ddof=1) / 2))
    # the gain pairs each prompt's mean with its reference label: a reference that moves with the
    # prompts cancels their spread
    ref = np.array([0.0, 1.0])
    assert gain_se(two, ref) == pytest.approx(np.sqrt(np.var(two.lam * np.array([0.0, 1.0]) - ref, ddof=1) / 2
                                                      + two.residual_var / 2))
    assert gain_se(two, ref) < np.sqrt(two.se ** 2 + np.var(ref, ddof=1) / 2)


def test_ppi_intervals_cover_the_prompt_distribution_not_just_the_expert_prompts():
    """100 prompts with their own difficulty (sd 0.15), 8 unlabelled samples and one expert label on each
    of 50 of them: the interval must cover the family's mean (over prompts), and the gain's interval the
    gain over a reference labelled once on every prompt. Counting the 800 samples as independent (the
    estimator before the prompt-level variance) covered 75%."""
    rng = np.random.default_rng(1)
    hits, gain_hits, naive = 0, 0, 0
    for _ in range(1000):
        u = 0.15 * rng.standard_normal(100)
        q = 0.5 + u[:, None] + 0.15 * rng.standard_normal((100, 8))      # the policy's samples' quality
        f = 0.2 + 0.7 * q + 0.05 * rng.standard_normal((100, 8))         # a biased but informative predictor
        lab = rng.permutation(100)[:50]
        ql = 0.5 + u[lab] + 0.15 * rng.standard_normal(50)
        y, fl = ql + 0.05 * rng.standard_normal(50), 0.2 + 0.7 * ql + 0.05 * rng.standard_normal(50)
        ref = 0.3 + u + 0.15 * rng.standard_normal(100)
        est = ppi_mean(f, fl, y, lab)
        hits += abs(est.estimate - 0.5) <= half_width(est.se, 50, 0.9)
        gain_hits += abs(est.estimate - ref.mean() - 0.2) <= half_width(gain_se(est, ref), 50, 0.9)
        flat = ppi_mean(f.ravel(), fl, y)     # as if every sample had a prompt of its own
        naive += abs(flat.estimate - 0.5) <= half_width(flat.se, 50, 0.9)
    assert 0.87 <= hits / 1000 <= 0.93
    assert 0.87 <= gain_hits / 1000 <= 0.94
    assert naive / 1000 < 0.80


def test_t_quantiles_and_the_union_bound():
    assert t_quantile(0.95, 10) == pytest.approx(1.8125, abs=1e-4)
    assert t_quantile(0.975, 19) == pytest.approx(2.0930, abs=1e-4)
    assert half_width(1.0, 20, 0.9, looks=5) == pytest.approx(t_quantile(0.99, 19))


def test_the_skew_correction_moves_the_interval_towards_where_skewed_labels_miss():
    """Quality near 0 (prompts' difficulty Beta(0.6, 6), fraction-of-8 labels plus the expert's unclipped
    noise, as the annotator and the seed's expert give them), 25 labels: the symmetric t interval misses
    high (the truth above it) more than twice as often as low; Hall's correction moves it up and covers more."""
    rng = np.random.default_rng(0)
    plain, moved, n, mu, ups = np.zeros(3), np.zeros(3), 25, 0.6 / 6.6, 0
    for _ in range(1500):
        qp = rng.beta(0.6, 6, 100)
        qs = rng.binomial(8, np.repeat(qp[:, None], 8, 1)) / 8
        f = 0.1 + 0.5 * qs + 0.1 * rng.standard_normal(qs.shape)
        lab = rng.permutation(100)[:n]
        ql = rng.binomial(8, qp[lab]) / 8
        y = ql + 0.03 * rng.standard_normal(n)
        est = ppi_mean(f, 0.1 + 0.5 * ql + 0.1 * rng.standard_normal(n), y, lab)
        hw, shift = half_width(est.se, n, 0.9), skew_shift(est, est.lam * est.prompt_means, est.se, 0.9)
        assert abs(shift) <= 0.54 * est.se      # never more than the clip allows
        ups += shift > 0
        for tally, c in ((plain, est.estimate), (moved, est.estimate + shift)):
            tally += [c - hw <= mu <= c + hw, mu < c - hw, mu > c + hw]
    assert ups > 0.9 * 1500                      # right-skewed labels: up, almost always
    assert plain[2] > 2 * plain[1]               # the symmetric interval's misses lie high
    assert moved[0] >= plain[0] + 8              # >= 0.5 point more coverage (0.9 here; 1.9 when the noise was clipped)
    assert moved[2] <= plain[2] - 20             # from fewer misses high
    symmetric = ppi_mean(np.full((100, 8), 0.5), np.full(4, 0.5), np.array([0.2, 0.4, 0.6, 0.8]))
    assert skew_shift(symmetric, symmetric.prompt_means, symmetric.se, 0.9) == pytest.approx(0.0, abs=1e-12)


def test_ppi_intervals_cover_at_their_level():
    rng = np.random.default_rng(0)
    hits, width_ppi, width_labels = 0, [], []
    for _ in range(1000):
        x = rng.random(840)
        y = np.clip(0.3 + 0.4 * x + 0.15 * rng.standard_normal(840), 0, 1)
        f = 0.1 + 0.8 * x  # a biased but informative predictor
        est = ppi_mean(f[40:], f[:40], y[:40])
        hw = half_width(est.se, 40, 0.9)
        hits += abs(est.estimate - 0.5) <= hw  # E[y] = 0.5 (clipping is symmetric here up to 1e-4)
        width_ppi.append(hw)
        width_labels.append(half_width(np.std(y[:40], ddof=1) / np.sqrt(40), 40, 0.9))
    assert 0.87 <= hits / 1000 <= 0.93
    assert np.mean(width_ppi) < 0.8 * np.mean(width_labels)  # the predictor buys a narrower interval


def test_labels_on_one_family_leave_every_other_number_as_it_was(tiny_world, tmp_path):
    """A policy with no labels is certified exactly as without the feature; labels on dune change dune
    only (its off-policy row kept beside), and too few labels change nothing but the reason."""
    ref, gold = os.path.join(tiny_world, "policy"), WorldPaths(tiny_world).expert_set
    policy_dir = sharpened(tiny_world, str(tmp_path / "p"), 1.2)
    rm_dir = os.path.join(tiny_world, "reward_model")
    requests = draw_requests(M.load_policy(policy_dir)[0], D.read_jsonl(gold, labelled=True), 20, ["dune", "ember"])
    labels = label_requests(WorldPaths(tiny_world), [r for r in requests if r["family"] == "dune"]
                            + [r for r in requests if r["family"] == "ember"][:5])
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in labels))
    bare = certify(policy_dir, ref, gold, rm_dir=rm_dir)
    with_labels = certify(policy_dir, ref, gold, rm_dir=rm_dir, policy_labels=str(path))
    keys = ("certifiable", "estimate", "lo", "hi", "gain", "gain_lo", "gain_hi", "ess", "kl")
    for f, row in bare["families"].items():
        got = with_labels["families"][f]
        if f == "dune":  # where the expert set vouches for dune, its labels join the expert set's evidence
            joint = row["certifiable"]
            assert got["method"] == ("ppi+dr" if joint else "ppi")
            assert got["evidence"].startswith("expert set + policy labels (20)" if joint else "policy labels (20)")
            assert sum(got["evidence_weights"].values()) == pytest.approx(1.0)
            assert got["off_policy"] == {k: row.get(k) for k in got["off_policy"]}
        else:
            assert {k: got[k] for k in keys} == {k: row[k] for k in keys}, f
    assert "5 policy labels < 20" in with_labels["families"]["ember"]["reason"]
    assert all(bare["families"][f]["certifiable"] for f in ("ember", "fjord"))  # numbers, not two Nones, compared
    # label_combine=False: the labels alone, as estimator 5 certified them
    alone = certify(policy_dir, ref, gold, rm_dir=rm_dir, policy_labels=str(path), cfg=CertifyConfig(label_combine=False))
    assert alone["families"]["dune"]["evidence"] == "policy labels (20)" and alone["families"]["dune"]["method"] == "ppi"
    assert {k: alone["families"]["ember"][k] for k in keys} == {k: bare["families"]["ember"][k] for k in keys}


def _register(path: str) -> str:
    with T.tracked_run("train_rl", {"policy": path}):
        _, mv = log_policy(path, tags={"recipe": os.path.basename(path)})
    return str(mv.version)


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _labelled(world: str, version: str, tmp_path, per_family: int = 20) -> str:
    res = _run("label-requests", "--model-version", version, "--world", world, "--families", "all",
               "--per-family", per_family, "--out", tmp_path / f"req{version}.jsonl")
    assert res.exit_code == 0, res.output
    res = _run("expert-label", "--world", world, "--requests", tmp_path / f"req{version}.jsonl",
               "--out", tmp_path / f"lab{version}.jsonl")
    assert res.exit_code == 0, res.output
    return str(tmp_path / f"lab{version}.jsonl")


def test_labels_certify_a_policy_the_expert_set_cannot_and_release_promotes_it(tiny_world, tmp_path):
    far = _register(sharpened(tiny_world, str(tmp_path / "far")))
    assert _run("certify", "--model-version", far, "--world", tiny_world).exit_code == 0
    assert _run("release", "--model-version", far, "--guardrails", LENIENT).output.count('"refused"') == 1
    labels = _labelled(tiny_world, far, tmp_path)
    res = _run("certify", "--model-version", far, "--world", tiny_world, "--policy-labels", labels)
    assert res.exit_code == 0, res.output
    client = mlflow.MlflowClient()
    mv = client.get_model_version(REGISTERED_MODEL, far)
    shown = [k for k in mv.tags if not k.startswith("failed.")]  # failed.<guardrail>: one per guardrail it failed
    assert len(shown) <= 8 and "expert_labels.total" not in mv.tags  # the count: the certify run's metric
    run = client.get_run(mv.tags["certification.run_id"])
    assert run.data.metrics["certify/policy_labels/total"] == 120
    table = json.load(open(mlflow.artifacts.download_artifacts(run_id=run.info.run_id,
                                                               artifact_path="certify_families.json")))
    assert dict(zip(*[[row[table["columns"].index(c)] for row in table["data"]] for c in ("family", "policy_labels")]))[
        "dune"] == 20
    report = json.load(open(mlflow.artifacts.download_artifacts(run_id=run.info.run_id,
                                                                artifact_path="certification.json")))
    used = report["labels_used"]  # every label named: its file, the file's sha256, the answers it was bought on
    assert used["file"] == os.path.abspath(labels) and used["sha256"] == hashlib.sha256(open(labels, "rb").read()).hexdigest()
    assert used["bought_on"] == {"registered_model": REGISTERED_MODEL, "model_version": far,
                                 "label_requests_run": mv.tags["label_requests.run_id"]}
    assert sorted(i for ids in used["ids"].values() for i in ids) == sorted(json.loads(x)["id"] for x in open(labels))
    assert f"bought on version {far}'s answers" in open(mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="certification.md")).read()
    oracle, policy = Oracle(tiny_world), M.load_policy(sharpened(tiny_world, str(tmp_path / "again")))[0]
    truth = oracle.grade_policy(policy, D.read_jsonl(WorldPaths(tiny_world).expert_set, labelled=True), n=32)
    for f, row in report["families"].items():
        assert row["evidence"] == "policy labels (20)" and row["certifiable"]
        assert row["lo"] - 0.05 <= truth[f"truth/{f}"] <= row["hi"] + 0.05, (f, row, truth)
    res = _run("release", "--model-version", far, "--guardrails", LENIENT)
    assert res.exit_code == 0 and '"decision": "promoted"' in res.output, res.output  # recomputed with its labels


def _edit(path: str, change) -> str:
    rows = [json.loads(line) for line in open(path)]
    change(rows)
    out = path + ".edited"
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return out


@pytest.fixture(scope="module")
def labelled_store(tiny_world, tmp_path_factory):
    """Two versions (the reference and a sharpened policy), each with 3 label requests per family and
    their expert labels, in a store made once for the module."""
    def build(root):
        v1 = _register(os.path.join(tiny_world, "policy"))
        v2 = _register(sharpened(tiny_world, str(root / "p2"), 2.0))
        return v1, v2, {v: _labelled(tiny_world, v, root, per_family=3) for v in (v1, v2)}
    return store_made_once(tmp_path_factory, "labels", build)


@pytest.fixture
def store(labelled_store, tmp_path, tracking_uri):
    """This test's own copy of the module's store."""
    root, built = labelled_store
    copy_store(root, tmp_path)
    return built


@pytest.mark.parametrize("case,message", [
    ("duplicate", "duplicated id"),
    ("range", "'label' 35.5 is outside the plausible range of expert labels [-1, 2]"),
    ("nan", "'label' must be"),
    ("other_version", "not among the label requests"),
    ("edited_response", "response differ from the request"),
])
def test_bad_labels_are_refused_and_the_version_left_untagged(tiny_world, store, case, message):
    v1, v2, files = store
    labels, other = files[v1], files[v2]
    edits = {"duplicate": lambda r: r.append(dict(r[0])), "range": lambda r: r[0].update(label=35.5),
             "nan": lambda r: r[0].update(label=float("nan"))}
    path = {"other_version": other,
            "edited_response": _edit(labels, lambda r: r[0].update(response=list(reversed(r[0]["response"]))))
            }.get(case) or _edit(labels, edits[case])
    before = dict(mlflow.MlflowClient().get_model_version(REGISTERED_MODEL, v1).tags)
    res = _run("certify", "--model-version", v1, "--world", tiny_world, "--policy-labels", path)
    assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output, res.output
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string="tags.`rlhf.step` = 'certify'")
    if case in ("duplicate", "range", "nan"):  # the file alone is bad: refused before any run
        assert not runs
    else:  # checked against the requests logged for the version, inside the run
        (run,) = runs
        assert run.info.status == "FAILED"
    assert dict(mlflow.MlflowClient().get_model_version(REGISTERED_MODEL, v1).tags) == before


def test_requests_edited_after_they_were_logged_are_refused(tiny_world, store, tmp_path):
    v1, _, files = store
    mv = mlflow.MlflowClient().get_model_version(REGISTERED_MODEL, v1)
    run = mlflow.get_run(mv.tags["label_requests.run_id"])
    logged = os.path.join(run.info.artifact_uri.removeprefix("file://"), "label_requests.jsonl")
    original = open(logged).read()
    try:
        open(logged, "a").write(original.splitlines(keepends=True)[0])
        res = _run("certify", "--model-version", v1, "--world", tiny_world, "--policy-labels", files[v1])
    finally:
        open(logged, "w").write(original)  # the module's store is shared
    assert res.exit_code == 1 and "changed after they were logged" in res.output


def test_portable_label_requests_draw_what_the_step_draws(tiny_world, tmp_path):
    w = WorldPaths(tiny_world)
    assert label_requests_main(["--policy", w.policy, "--reference", w.policy, "--gold", w.expert_set,
                                "--per-family", "4", "--out", str(tmp_path / "r.jsonl")]) == 0
    portable = [json.loads(line) for line in open(tmp_path / "r.jsonl")]
    again = draw_requests(M.load_policy(w.policy)[0], D.read_jsonl(w.expert_set, labelled=True), 8)
    first4 = [r for r in again if int(r["id"].rsplit("-", 1)[1]) < 4]  # K=4 is a prefix of K=8
    assert [r["response"] for r in portable] == [r["response"] for r in first4] and len(portable) == 24
    from rlhf_mlflow.world.annotator import label_requests as annotate
    labelled = tmp_path / "l.jsonl"
    labelled.write_text("".join(json.dumps(r) + "\n" for r in annotate(w, portable)))
    assert certify_main(["--policy", w.policy, "--reference", w.policy, "--gold", w.expert_set, "--rm-dir",
                         w.reward_model, "--policy-labels", str(labelled), "--min-labels", "4",
                         "--out", str(tmp_path / "c.json")]) == 0
    report = json.load(open(tmp_path / "c.json"))
    assert all(r["evidence"] == "policy labels (4)" for r in report["families"].values())
