"""Each step as a real MLflow run on a real sqlite store: logged keys, registry, failures, agreement."""
from __future__ import annotations

import dataclasses
import os

import mlflow
import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from rlhf_mlflow.cli import cli
from rlhf_mlflow.training.rl_config import RLConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _runs(step):
    return mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.`rlhf.step` = '{step}'",
                              output_format="list")


def test_train_rl_run_logs_family_curves_checkpoints_and_registers(tiny_world):
    res = _run("train-rl", "--world", tiny_world, "--steps", 6, "--log-every", 2, "--save-every", 3,
               "--batch-prompts", 6, "--samples-per-prompt", 4, "--run-name", "tiny")
    assert res.exit_code == 0, res.output
    (run,) = _runs("train_rl")
    assert run.info.status == "FINISHED"
    client = mlflow.MlflowClient()
    hist = client.get_metric_history(run.info.run_id, "train/kl/balanced")
    assert [m.step for m in hist] == [2, 4, 6]
    for key in ("proxy/balanced", "proxy/dune", "kl/ember", "stats/kl_k3", "stats/entropy", "stats/top_token_share",
                "stats/shaped", "stats/reward", "stats/loss", "stats/grad_norm", "stats/steps_per_s"):
        assert "train/" + key in run.data.metrics, key
    assert not any("entropy/" in k for k in run.data.metrics)  # per family in figures/family_curves.png
    # the MLflow UI's sections (a key up to its last /, in alphabetical order): proxy and kl first
    assert sorted({k.rsplit("/", 1)[0] for k in run.data.metrics}) == ["train/kl", "train/proxy", "train/stats"]
    assert run.data.params["kl_coef"] == "0.1" and run.data.params["steps"] == "6"
    assert len(run.data.params["world_hash"]) == 16
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert arts == {"checkpoints/final", "checkpoints/step_3"}
    final = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints/final")}
    assert "checkpoints/final/policy.safetensors" in final
    assert any(a.path.endswith(".png") for a in client.list_artifacts(run.info.run_id, "figures"))
    assert run.inputs.dataset_inputs and run.inputs.dataset_inputs[0].dataset.name == "prompts_train.jsonl"

    version = client.get_model_version("rlhf-policy", "1")
    assert version.run_id == run.info.run_id and version.tags["recipe"] == "tiny"
    assert version.tags["world_hash"] == run.data.params["world_hash"]
    model = mlflow.pyfunc.load_model("models:/rlhf-policy/1")
    out = model.predict(pd.DataFrame({"id": ["a", "b"], "family": ["dune", "anvil"], "attrs": [[1, 2, 3, 4], [0] * 4]}))
    assert list(out.columns) == ["id", "family", "response", "logprob"]
    assert all(len(r.split()) == 8 for r in out["response"]) and (out["logprob"] < 0).all()


def test_dev_eval_links_metrics_to_the_model(tiny_world):
    assert _run("train-rl", "--world", tiny_world, "--steps", 2, "--batch-prompts", 4,
                "--samples-per-prompt", 2).exit_code == 0
    res = _run("dev-eval", "--policy", "models:/rlhf-policy/1", "--world", tiny_world)
    assert res.exit_code == 0, res.output
    (run,) = _runs("dev_eval")
    assert {d.dataset.name for d in run.inputs.dataset_inputs} == {"prompts_dev.jsonl", "gold_calib.jsonl"}
    assert {"dev/proxy_mean", "dev/kl_mean", "dev/rm_gold_pearson", "dev/proxy/balanced",
            "dev/kl/balanced"} <= set(run.data.metrics)
    assert not {k for k in run.data.metrics if k.endswith(("/dune", "/pilot"))}  # per family: the table
    table = mlflow.load_table("dev_eval_families.json", run_ids=[run.info.run_id])
    assert {"dune", "balanced", "pilot"} <= set(table["family"]) and table["proxy"].notna().all()
    model_id = mlflow.models.get_model_info("models:/rlhf-policy/1").model_id
    logged = mlflow.get_logged_model(model_id)
    assert {m.key for m in logged.metrics} >= {"dev/proxy_mean", "dev/kl/balanced"}


def test_a_failing_run_is_marked_failed_and_registers_nothing(tiny_world, tmp_path):
    wrapper = tmp_path / "bad.py"
    wrapper.write_text("def transform(records, tokens, rewards):\n    return rewards[:-1]\n")
    res = _run("train-rl", "--world", tiny_world, "--steps", 2, "--reward-wrapper", wrapper)
    assert res.exit_code == 1
    assert res.output.strip().splitlines()[-1].startswith("Error: reward_wrapper")
    (run,) = _runs("train_rl")
    assert run.info.status == "FAILED"
    assert not mlflow.MlflowClient().search_registered_models()


def test_bad_parameter_fails_before_any_run(tiny_world):
    res = _run("train-rl", "--world", tiny_world, "--kl-coef", -1)
    assert res.exit_code == 1 and "kl_coef must be a number in [0, 100]" in res.output
    assert not [r for r in _runs("train_rl") if r.info.status == "RUNNING"]


def test_train_rm_and_bon_runs(tiny_world, tmp_path):
    res = _run("train-rm", "--data", os.path.join(tiny_world, "reward_model", "train.jsonl"), "--epochs", 2,
               "--out", tmp_path / "rm", "--gold", os.path.join(tiny_world, "data", "gold_calib.jsonl"))
    assert res.exit_code == 0, res.output
    (run,) = _runs("train_rm")
    assert len(mlflow.MlflowClient().get_metric_history(run.info.run_id, "rm/loss")) == 2
    assert run.info.run_name == "train_rm"
    assert "rm/gold_pearson/dune" in run.data.metrics and "rm/label_pearson/anvil" in run.data.metrics
    res = _run("bon", "--policy", os.path.join(tiny_world, "policy"), "--reward-model", tmp_path / "rm",
               "--prompts", os.path.join(tiny_world, "data", "prompts_dev.jsonl"), "--n", 3, "--limit", 5)
    assert res.exit_code == 0, res.output
    (run,) = _runs("bon")
    assert "bon/bon_proxy/balanced" in run.data.metrics
    assert [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "samples")] == [
        "samples/samples.jsonl"]


def test_mlproject_click_and_config_agree():
    with open(os.path.join(ROOT, "MLproject")) as f:
        project = yaml.safe_load(f)
    params = project["entry_points"]["train_rl"]["parameters"]
    command = cli.commands["train-rl"]
    options = {p.name: p for p in command.params}
    mltype = {int: "int", float: "float", str: "string"}
    for field in dataclasses.fields(RLConfig):
        default = "" if field.default is None else field.default
        assert field.name in params, field.name
        assert field.name in options, field.name
        assert params[field.name]["default"] == default, field.name
        assert options[field.name].default == default, field.name
        kind = str if field.name == "family_weights" else type(default)
        assert params[field.name]["type"] == mltype[kind], field.name
        assert f"--{field.name.replace('_', '-')} {{{field.name}}}" in project["entry_points"]["train_rl"]["command"]
    # every command is an entry point but the store's own tools
    assert {n.replace("_", "-") for n in project["entry_points"]} == set(cli.commands) - {"runs", "server"}
    for name, spec in project["entry_points"].items():
        cmd = cli.commands[name.replace("_", "-")]
        names = {p.name for p in cmd.params}
        for pname in spec["parameters"]:
            assert pname in names, (name, pname)


def test_build_world_run_logs_the_world(tmp_path):
    res = _run("build-world", "--seed", 2, "--scale", "test", "--out", tmp_path / "w")
    assert res.exit_code == 0, res.output
    (run,) = _runs("build_world")
    assert run.info.status == "FINISHED"
    assert run.data.params["seed"] == "2" and run.data.params["scale"] == "test"
    assert len(run.data.params["world_hash"]) == 16
    assert "build/total_s" in run.data.metrics
    names = {d.dataset.name for d in run.inputs.dataset_inputs}
    assert names == {"prompts_train.jsonl", "prompts_dev.jsonl", "gold_calib.jsonl", "train.jsonl"}
    assert [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)] == ["manifest.json"]


def test_train_rl_registers_the_checkpoint_a_chooser_picks(tiny_world):
    """`select` sees every checkpoint in step order (the final one last); the version registered is
    the chosen checkpoint's policy, tagged with its step."""
    from safetensors.torch import load_file

    from rlhf_mlflow.core.world_paths import WorldPaths
    from rlhf_mlflow.steps.train_rl import run_train_rl
    from rlhf_mlflow.tracking.policy_model import resolve_policy
    from rlhf_mlflow.training.rl_config import load_rl_config
    cfg = load_rl_config(os.path.join(tiny_world, "configs", "default.json"),
                         {"steps": 6, "save_every": 2, "batch_prompts": 4, "samples_per_prompt": 2, "log_every": 2})
    seen = []

    def pick_second(saved):
        seen.extend(s for s, _ in saved)
        return saved[1][0]
    summary = run_train_rl(cfg, world=WorldPaths.at(tiny_world), run_name="chosen", select=pick_second, progress=False,
                           echo=lambda m: None)
    assert seen == [2, 4, 6] and summary["registered_step"] == 4
    client = mlflow.MlflowClient()
    version = client.get_model_version("rlhf-policy", str(summary["model_version"]))
    assert version.tags["checkpoint_step"] == "4"
    run_id = summary["run_id"]
    assert client.get_run(run_id).data.tags["rlhf.registered_step"] == "4"
    registered = load_file(resolve_policy(f"models:/rlhf-policy/{version.version}")[0] + "/policy.safetensors")
    step4 = load_file(client.download_artifacts(run_id, "checkpoints/step_4") + "/policy.safetensors")
    final = load_file(client.download_artifacts(run_id, "checkpoints/final") + "/policy.safetensors")
    assert all((registered[k] == step4[k]).all() for k in step4)
    assert any((registered[k] != final[k]).any() for k in final)


def test_a_logged_dataset_input_says_nothing_and_names_its_file(tmp_path, tracking_uri):
    """MLflow 3.17 registers two local-file dataset sources and warned on every input a step logged (114
    warnings under `make test`); the step names its source class itself (tracking/runs.py)."""
    import warnings

    import mlflow.data  # noqa: F401  (its own import-time notes are not the point here)

    from rlhf_mlflow.tracking import runs as T
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "p-0", "family": "anvil"}\n')
    mlflow.set_experiment("dataset-input")
    with mlflow.start_run() as run, warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        T.log_records_input([{"id": "p-0", "family": "anvil"}], str(path), "training")
    (inp,) = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
    assert inp.dataset.name == "prompts.jsonl" and str(path) in inp.dataset.source


def _log_the_same_input(uri: str, path: str, barrier, results) -> None:
    """One writer of test_runs_logging_the_same_file_at_once_all_record_it: a run that logs `path` as
    its input the moment every other writer is ready to."""
    from rlhf_mlflow.tracking import runs as T
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=mlflow.get_experiment_by_name("race").experiment_id) as run:
        barrier.wait()
        try:
            T.log_records_input([{"id": "p-0", "family": "anvil"}], path, "training")
            results.put(run.info.run_id)
        except Exception as e:  # reported to the test, which names it
            results.put(f"{type(e).__name__}: {str(e)[:200]}")


@pytest.mark.slow  # ~30 s: twelve processes
def test_runs_logging_the_same_file_at_once_all_record_it(tmp_path):
    """A sweep's trials log the same prompt file at the same moment: MLflow looks the dataset up and
    inserts it in two statements, and three times in four one of four writers failed on the datasets
    table's unique key (the slow sweep test's trial died of it). Four real processes on a sqlite store."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    for store in range(3):  # a fresh store each time: the race is on the dataset's first insert
        uri = f"sqlite:///{tmp_path}/mlflow-{store}.db"
        mlflow.MlflowClient(uri).create_experiment("race", artifact_location=str(tmp_path / f"artifacts-{store}"))
        path = tmp_path / "prompts.jsonl"
        path.write_text('{"id": "p-0", "family": "anvil"}\n')
        barrier, results = ctx.Barrier(4), ctx.Queue()
        writers = [ctx.Process(target=_log_the_same_input, args=(uri, str(path), barrier, results))
                   for _ in range(4)]
        for w in writers:
            w.start()
        got = [results.get(timeout=120) for _ in writers]
        for w in writers:
            w.join(timeout=60)
        client = mlflow.MlflowClient(uri)
        assert all(len(g) == 32 for g in got), (store, got)
        assert all(len(client.get_run(g).inputs.dataset_inputs) == 1 for g in got)
