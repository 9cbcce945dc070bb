"""The model protocol (core/protocol.py, issue 46): a policy or reward model implemented outside the
project, named by an import path (`--policy-impl test_protocol:...`: this module is one), goes through
certify's off-policy path, dev_eval and the diagnostic and gives our class's numbers; an implementation
of its own (the seed architecture written here from the checkpoint's tensors, its own sampler) certifies
too; a broken one is named in one line; an MLflow pyfunc model version is asked through `predict`."""
from __future__ import annotations

import json
import os

import mlflow
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file
from test_certify import sharpened

from rlhf_mlflow.cli import cli, portable
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.evidence.certify import certify

HERE = "test_protocol"


class WrappedPolicy:
    """Another stack's policy written against the protocol alone: it holds the checkpoint's tensors in a
    module and answers with core's sampler and log-probs; no class of ours is handed to the project."""

    def __init__(self, location: str):
        self.net = M.load_policy(location)[0]

    def sample(self, prompts, n, temperature, generator, logprobs=None):
        return rollout.sample(self.net, prompts, n, temperature, generator, logprobs)

    def logprobs(self, prompts, responses):
        return M.sequence_logprobs(self.net, prompts, responses).numpy()  # numpy is fine: checked and converted


class WrappedRewardModel:
    def __init__(self, location: str):
        self.net = R.load_rm(location)[0]

    def score(self, prompts, responses):
        return R.score(self.net, prompts, responses)


class PlainPolicy:
    """The seed's policy written out here from policy.safetensors (plain torch ops, no cache), with its own
    sampler (torch.multinomial, one token at a time): the same model, another implementation."""

    def __init__(self, location: str):
        self.w = load_file(os.path.join(location, M.WEIGHTS))
        self.cfg = json.load(open(os.path.join(location, "config.json")))

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> content-token logits (B, T, C), causal."""
        w, d, h = self.w, self.cfg["d_model"], self.cfg["n_heads"]
        B, T = ids.shape
        x = w["tok.weight"][ids] + w["pos.weight"][:T]
        for i in range(self.cfg["n_layers"]):
            p = f"blocks.{i}."
            a = F.layer_norm(x, (d,), w[p + "ln1.weight"], w[p + "ln1.bias"])
            q, k, v = F.linear(a, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]).view(B, T, 3, h, d // h).unbind(2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + F.linear(att.transpose(1, 2).reshape(B, T, d), w[p + "attn.out.weight"], w[p + "attn.out.bias"])
            f = F.layer_norm(x, (d,), w[p + "ln2.weight"], w[p + "ln2.bias"])
            x = x + F.linear(F.gelu(F.linear(f, w[p + "ff.0.weight"], w[p + "ff.0.bias"])), w[p + "ff.2.weight"],
                             w[p + "ff.2.bias"])
        x = F.layer_norm(x, (d,), w["ln.weight"], w["ln.bias"])
        return F.linear(x, w["head.weight"][V.CONTENT_LO:V.CONTENT_HI])

    @torch.no_grad()
    def sample(self, prompts, n, temperature, generator, logprobs=None):
        out = prompts.repeat_interleave(n, 0)
        for _ in range(V.RESP_LEN):
            probs = torch.softmax(self._logits(out)[:, -1] / temperature, -1)
            out = torch.cat([out, torch.multinomial(probs, 1, generator=generator) + V.CONTENT_LO], 1)
        return out[:, prompts.shape[1]:]

    @torch.no_grad()
    def logprobs(self, prompts, responses):
        logp = torch.log_softmax(self._logits(torch.cat([prompts, responses], 1)[:, :-1])[:, prompts.shape[1] - 1:], -1)
        return logp.gather(-1, (responses - V.CONTENT_LO)[..., None]).squeeze(-1).sum(-1)


class ShortPolicy(WrappedPolicy):
    """A broken implementation: one response too few."""

    def sample(self, prompts, n, temperature, generator, logprobs=None):
        return super().sample(prompts, n, temperature, generator)[1:]


class ExternalPyfunc(mlflow.pyfunc.PythonModel):
    """A pyfunc model nobody here wrote the flavour for: PlainPolicy behind the frame contract
    (tracking/pyfunc_protocol.py), its weights an artifact that is not our `policy` one."""

    # its predict has no type hints, as a model from another stack may not; MLflow would say so once per
    # session, under a warnings filter of its own that no pytest setting reaches
    _skip_type_hint_validation = True

    def load_context(self, context):
        self.policy = PlainPolicy(context.artifacts["weights"])

    def predict(self, context, model_input, params=None):
        prompts = torch.tensor([V.encode_prompt(f, list(a)) for f, a in zip(model_input["family"], model_input["attrs"])])
        if "response" in model_input and model_input["response"].notna().all():
            responses = torch.tensor([V.encode_response(r.split()) for r in model_input["response"]])
        else:
            params = params or {}
            gen = torch.Generator().manual_seed(int(params.get("seed", 0)))
            responses = self.policy.sample(prompts, 1, float(params.get("temperature", 1.0)), gen)
        return model_input.assign(response=[" ".join(V.decode_response(y)) for y in responses.tolist()],
                                  logprob=self.policy.logprobs(prompts, responses).tolist())


def wrapped_policy(location: str) -> WrappedPolicy:
    return WrappedPolicy(location)


def wrapped_rm(location: str) -> WrappedRewardModel:
    return WrappedRewardModel(location)


def plain_policy(location: str) -> PlainPolicy:
    return PlainPolicy(location)


def short_policy(location: str) -> ShortPolicy:
    return ShortPolicy(location)


def not_a_policy(location: str) -> dict:
    return {"location": location}


def _numbers(report: dict) -> dict:
    return {"families": report["families"], "balanced": report["balanced"], "pilot": report.get("pilot")}


def test_a_policy_and_reward_model_named_by_import_path_certify_as_ours(tiny_world, tmp_path):
    """certify's off-policy path (the doubly-robust estimate with the reward model) through another
    implementation named on the command line: the same report, number for number."""
    world = WorldPaths.at(tiny_world)
    policy = sharpened(tiny_world, str(tmp_path / "policy"), 1.6)
    ours = certify(policy, world.policy, world.expert_set, rm_dir=world.reward_model)
    out = tmp_path / "theirs.json"
    assert portable.certify_main(["--policy", policy, "--reference", world.policy, "--gold", world.expert_set,
                                  "--rm-dir", world.reward_model, "--out", str(out),
                                  "--policy-impl", f"{HERE}:wrapped_policy", "--reward-impl", f"{HERE}:wrapped_rm"]) == 0
    theirs = json.load(open(out))
    assert _numbers(theirs) == json.loads(json.dumps(_numbers(ours)))
    assert any(r["kl"] > 0.01 for r in ours["families"].values())  # a policy that is not the reference
    assert theirs["inputs"]["policy_impl"] == f"{HERE}:wrapped_policy" and "policy_impl" not in ours["inputs"]


def test_an_implementation_of_its_own_certifies_as_ours_does(tiny_world, tmp_path):
    """The seed architecture written out here, with its own sampler: its log-probs are ours to float
    tolerance, so what certify reads of the expert rows (ESS, k-hat, SNIPS) is ours; its own samples are
    other draws, so the KL and the certified estimates agree as two samplings of one policy do."""
    world = WorldPaths.at(tiny_world)
    policy = sharpened(tiny_world, str(tmp_path / "policy"), 1.6)
    gold = D.read_jsonl(world.expert_set, labelled=True)
    prompts, responses = D.prompts_tensor(gold), D.responses_tensor(gold)
    np.testing.assert_allclose(PlainPolicy(policy).logprobs(prompts, responses),
                               M.sequence_logprobs(M.load_policy(policy)[0], prompts, responses), atol=1e-4)
    ours = certify(policy, world.policy, world.expert_set, rm_dir=world.reward_model)
    theirs = certify(policy, world.policy, world.expert_set, rm_dir=world.reward_model,
                     policy_impl=f"{HERE}:plain_policy")
    both = 0
    for f, a in ours["families"].items():
        b = theirs["families"][f]
        for key in ("ess", "khat", "snips", "reference"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-3), (f, key)
        assert abs(b["kl"] - a["kl"]) < 0.15 and b["kl"] > 0.05, f
        if a["certifiable"] and b["certifiable"]:
            both += 1
            assert abs(b["estimate"] - a["estimate"]) < 0.02 and b["lo"] < b["estimate"] < b["hi"], f
    assert both >= 4, {f: r["reason"] for f, r in theirs["families"].items()}


def test_dev_eval_and_the_diagnostic_through_an_import_path_give_our_numbers(tiny_world, tmp_path):
    policy = sharpened(tiny_world, str(tmp_path / "policy"), 1.6)
    impls = ["--policy-impl", f"{HERE}:wrapped_policy", "--reward-impl", f"{HERE}:wrapped_rm"]
    metrics = []
    for name, extra in (("ours", []), ("theirs", impls)):
        res = CliRunner().invoke(cli, ["dev-eval", "--policy", policy, "--world", tiny_world, "--out",
                                       str(tmp_path / f"dev-{name}.json"), *extra], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        metrics.append(json.load(open(tmp_path / f"dev-{name}.json")))
    assert metrics[0] == metrics[1] and metrics[0]["kl/balanced"] > 0.01
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert {r.data.params.get("policy_impl") for r in runs} == {None, f"{HERE}:wrapped_policy"}
    world = WorldPaths.at(tiny_world)
    args = ["--rm-dir", world.reward_model, "--policy-dir", world.policy, "--prompts", world.prompts_train,
            "--n-prompts", "8"]
    assert portable.diagnostic_main([*args, "--out", str(tmp_path / "diag-ours.json")]) == 0
    assert portable.diagnostic_main([*args, "--out", str(tmp_path / "diag-theirs.json"), *impls]) == 0
    ours, theirs = (json.load(open(tmp_path / f"diag-{n}.json")) for n in ("ours", "theirs"))
    assert ours == theirs and ours["families"]


@pytest.mark.parametrize("impl, says", [
    (f"{HERE}:short_policy", "ShortPolicy: sample returned shape"),
    (f"{HERE}:not_a_policy", "returned a dict, not a policy"),
    ("no_such_module_here:factory", "cannot import no_such_module_here"),
    (f"{HERE}", "expected an import path 'package.module:factory'"),
])
def test_a_broken_implementation_is_one_line_naming_it(tiny_world, tmp_path, capsys, impl, says):
    world = WorldPaths.at(tiny_world)
    out = tmp_path / "report.json"
    assert portable.certify_main(["--policy", world.policy, "--reference", world.policy, "--gold", world.expert_set,
                                  "--out", str(out), "--policy-impl", impl]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0] and "Traceback" not in err[0], err
    assert not out.exists()


def test_a_pyfunc_model_version_is_a_policy_through_predict(tiny_world, tmp_path):
    """Our pyfunc answers both questions through `predict` (a sampled response with its log-prob; the
    log-prob of a given response), so a version is evaluated without its checkpoint: dev-eval of the
    reference against itself through the pyfunc measures KL 0."""
    from rlhf_mlflow.tracking import pyfunc_protocol as PF
    from rlhf_mlflow.tracking import runs as T
    from rlhf_mlflow.tracking.policy_model import log_policy
    world = WorldPaths.at(tiny_world)
    with T.tracked_run("train_rl", {"policy": world.policy}):
        log_policy(world.policy)
    model = PF.load("models:/rlhf-policy/1")
    gold = D.read_jsonl(world.expert_set, labelled=True)[:40]
    prompts, responses = D.prompts_tensor(gold), D.responses_tensor(gold)
    ours = M.sequence_logprobs(M.load_policy(world.policy)[0], prompts, responses)
    assert torch.equal(model.logprobs(prompts, responses).float(), ours)  # float32 both ways
    drawn = [], []
    for lp in drawn:
        model.sample(prompts[:6], 3, 1.0, torch.Generator().manual_seed(5), lp)
    assert torch.equal(drawn[0][0], drawn[1][0]) and drawn[0][0].shape == (18,)  # seeded by the caller's stream
    res = CliRunner().invoke(cli, ["dev-eval", "--policy", "models:/rlhf-policy/1", "--world", tiny_world,
                                   "--policy-ref", world.policy, "--policy-impl", "rlhf_mlflow.tracking.pyfunc_protocol:load",
                                   "--out", str(tmp_path / "dev.json")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    metrics = json.load(open(tmp_path / "dev.json"))
    assert abs(metrics["kl/balanced"]) < 1e-4 and np.isfinite(metrics["proxy/balanced"])


def test_a_pyfunc_model_of_another_flavour_is_evaluated_through_predict(tiny_world, tmp_path):
    """dev-eval --policy models:/... of a pyfunc model that is not ours (no checkpoint of ours inside) asks
    it through `predict` without being told: the reference written another way, against itself, KL ~0."""
    world = WorldPaths.at(tiny_world)
    with mlflow.start_run(experiment_id=mlflow.create_experiment("external")):
        mlflow.pyfunc.log_model(name="theirs", python_model=ExternalPyfunc(), artifacts={"weights": world.policy},
                                registered_model_name="their-policy")
    res = CliRunner().invoke(cli, ["dev-eval", "--policy", "models:/their-policy/1", "--world", tiny_world,
                                   "--out", str(tmp_path / "dev.json")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    metrics = json.load(open(tmp_path / "dev.json"))
    assert abs(metrics["kl/balanced"]) < 1e-3 and metrics["kl/balanced"] != 0.0  # two implementations, one model


def test_a_certification_through_an_implementation_is_recomputed_through_it_by_release(tiny_world, tmp_path):
    """`certify --model-version V --policy-impl M:F --reward-impl M:F`: the implementations are parameters of
    the certify run and inputs of its report, and release recomputes the certification through them."""
    from rlhf_mlflow.tracking import runs as T
    from rlhf_mlflow.tracking.policy_model import log_policy
    from rlhf_mlflow.tracking.registry import release_record
    policy = sharpened(tiny_world, str(tmp_path / "policy"), 1.6)
    with T.tracked_run("train_rl", {"policy": policy}):
        _, version = log_policy(policy, tags={"recipe": "theirs"})
    impls = ["--policy-impl", f"{HERE}:wrapped_policy", "--reward-impl", f"{HERE}:wrapped_rm"]
    res = CliRunner().invoke(cli, ["certify", "--model-version", version.version, "--world", tiny_world, *impls])
    assert res.exit_code == 0, res.output
    run_id = mlflow.MlflowClient().get_model_version("rlhf-policy", version.version).tags["certification.run_id"]
    assert mlflow.get_run(run_id).data.params["policy_impl"] == f"{HERE}:wrapped_policy"
    res = CliRunner().invoke(cli, ["release", "--model-version", version.version, "--guardrails",
                                   "min_balanced_gain=-1,require_significant_gain=false,min_family_change=-1,"
                                   "waive=marker_collapse"])
    assert res.exit_code == 0 and "recomputed" in res.output, res.output
    record = release_record(mlflow.MlflowClient().get_model_version("rlhf-policy", version.version))
    assert record["evidence"] == "recomputed"
