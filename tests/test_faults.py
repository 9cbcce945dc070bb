"""Faults a user meets: unwritable or occupied outputs, bad inputs, misbehaving reward wrappers, and
writes that fail half-way. Each ends in one clear error line, a FAILED run (if one started), files
that are whole or absent, and an untouched registry; on a real sqlite store and a test-scale world."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys

import mlflow
import pytest
import torch
from click.testing import CliRunner

from cli_checks import fails as _fails
from rlhf_mlflow.cli import cli
from rlhf_mlflow.core import checkpoint, files
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.reward_wrapper import RewardWrapper, apply_wrapper, load_wrapper

TINY = ["--steps", 2, "--log-every", 1, "--batch-prompts", 4, "--samples-per-prompt", 2]
UNWRITABLE = "/proc/rlhf-x"  # /proc accepts no new files, even from root


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _runs(step: str) -> list:
    return mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.`rlhf.step` = '{step}'",
                              output_format="list")


def _versions() -> list:
    return mlflow.MlflowClient().search_model_versions("name = 'rlhf-policy'")


def _train(world, *extra) -> dict:
    res = _run("train-rl", "--world", world, *TINY, *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.output[res.output.index("{"):])


def _copy_world(world, tmp_path, name="world"):
    dst = tmp_path / name
    shutil.copytree(world, dst)
    return dst


def _leftovers(directory) -> list[str]:
    """Temporary siblings the atomic writers would leave behind on a bug."""
    return [n for n in os.listdir(directory) if ".tmp-" in n or ".old-" in n]


# 1. atomic files ---------------------------------------------------------------------------------

def test_a_checkpoint_that_fails_mid_write_leaves_the_old_one_whole(tiny_world, tmp_path, monkeypatch):
    policy, cfg = M.load_policy(os.path.join(tiny_world, "policy"))
    target = tmp_path / "ckpt"
    M.save_policy(policy, cfg, str(target))
    before = (target / "policy.safetensors").read_bytes()

    def half_then_fail(tensors, path):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(checkpoint, "save_file", half_then_fail)
    with torch.no_grad():
        policy.head.weight.add_(1.0)
    with pytest.raises(OSError):
        M.save_policy(policy, cfg, str(target))
    assert (target / "policy.safetensors").read_bytes() == before
    assert sorted(os.listdir(target)) == ["config.json", "policy.safetensors"]
    assert not _leftovers(tmp_path)
    M.load_policy(str(target))  # still a loadable checkpoint


def test_a_checkpoint_replaces_an_existing_one_and_leaves_nothing_beside_it(tiny_world, tmp_path):
    policy, cfg = M.load_policy(os.path.join(tiny_world, "policy"))
    target = tmp_path / "ckpt"
    M.save_policy(policy, cfg, str(target))
    with torch.no_grad():
        policy.head.weight.add_(1.0)
    M.save_policy(policy, cfg, str(target))
    loaded = M.load_policy(str(target))[0]
    assert torch.equal(loaded.head.weight, policy.head.weight)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_checkpoint_beside_other_files_is_no_checkpoint_until_config_json_lands(tiny_world, tmp_path,
                                                                                 monkeypatch):
    """train-rl's --out holds step_N/ and logs beside the final policy: those stay, and a failed save
    leaves no config.json (so no half checkpoint a loader would read)."""
    policy, cfg = M.load_policy(os.path.join(tiny_world, "policy"))
    out = tmp_path / "run"
    M.save_policy(policy, cfg, str(out / "step_1"))
    (out / "log.jsonl").write_text("{}\n")
    M.save_policy(policy, cfg, str(out))
    assert sorted(os.listdir(out)) == ["config.json", "log.jsonl", "policy.safetensors", "step_1"]

    def fail(*args):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "policy.safetensors"))
    monkeypatch.setattr(checkpoint, "atomic_write_bytes", fail)
    with pytest.raises(OSError):
        M.save_policy(policy, cfg, str(out))
    assert sorted(os.listdir(out)) == ["log.jsonl", "policy.safetensors", "step_1"]
    with pytest.raises(InputError, match="no config.json"):
        M.load_policy(str(out))


def test_a_jsonl_file_that_fails_mid_write_keeps_its_old_contents(tmp_path):
    path = tmp_path / "recs.jsonl"
    recs = [{"id": str(i), "family": "dune", "attrs": [0, 1, 2, 3]} for i in range(3)]
    D.write_jsonl(str(path), recs)
    before = path.read_text()

    def records():
        yield recs[0]
        raise RuntimeError("the producer died")
    with pytest.raises(RuntimeError):
        D.write_jsonl(str(path), records())
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["recs.jsonl"]


def test_atomic_text_and_dir_helpers(tmp_path):
    files.atomic_write_text(str(tmp_path / "a" / "b.txt"), "one")
    assert (tmp_path / "a" / "b.txt").read_text() == "one"
    with pytest.raises(ValueError):
        with files.atomic_dir(str(tmp_path / "d")) as d:
            open(os.path.join(d, "x"), "w").close()
            raise ValueError("half")
    assert sorted(os.listdir(tmp_path)) == ["a"]
    with files.atomic_dir(str(tmp_path / "d")) as d:
        open(os.path.join(d, "x"), "w").close()
    assert os.listdir(tmp_path / "d") == ["x"] and not _leftovers(tmp_path)


# 2. --out checked before any work ----------------------------------------------------------------

@pytest.mark.parametrize("command,step", [
    (["train-rl", "--out", UNWRITABLE, *TINY], "train_rl"),
    (["dev-eval", "--policy", "{world}/policy", "--out", UNWRITABLE + ".json"], "dev_eval"),
    (["diagnostic", "--out", UNWRITABLE + ".json"], "diagnostic"),
    (["certify", "--policy", "{world}/policy", "--out", UNWRITABLE + ".json"], "certify"),
    (["bon", "--policy", "{world}/policy", "--reward-model", "{world}/reward_model", "--prompts",
      "{world}/data/prompts_dev.jsonl", "--out", UNWRITABLE + ".jsonl"], "bon"),
    (["train-rm", "--data", "{world}/reward_model/train.jsonl", "--out", UNWRITABLE], "train_rm"),
    (["build-world", "--scale", "test", "--out", UNWRITABLE], "build_world"),
    (["main", "--out", UNWRITABLE], "main"),
])
def test_an_unwritable_out_is_refused_before_any_run(tiny_world, command, step):
    args = [str(a).format(world=tiny_world) for a in command]
    if step in ("train_rl", "dev_eval", "diagnostic", "certify", "main"):
        args += ["--world", tiny_world]
    line = _fails(_run(*args), "--out /proc/rlhf-x", "cannot write in /proc")
    assert len(line) < 200
    assert not _runs(step) and not _versions()


@pytest.mark.parametrize("spending", ["0.9,0.9", "0.7,x", "0,1"])
@pytest.mark.parametrize("command", [["certify", "--policy", "{world}/policy", "--world", "{world}"],
                                     ["certify-table", "--samples", "s.jsonl", "--labels", "l.jsonl", "--register", "x",
                                      "--model-uri", "{world}/policy"]])
def test_a_bad_spending_rule_is_one_line_before_any_run(tiny_world, command, spending):
    args = [str(a).format(world=tiny_world) for a in command] + ["--label-spending", spending]
    line = _fails(_run(*args), f"label_spending '{spending}'")
    assert len(line) < 200 and not _runs("certify") and not _versions()


def test_correct_with_an_unwritable_out_starts_no_run(tiny_world, tmp_path):
    diag = tmp_path / "diag.json"
    diag.write_text(json.dumps({"families": {}}))
    _fails(_run("correct", "--diagnostic", diag, "--qa", f"{tiny_world}/reward_model/train.jsonl",
                "--out", UNWRITABLE + ".py"), "--out /proc/rlhf-x.py")
    assert not _runs("correction")


def test_an_out_that_is_a_directory_or_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="is a directory"):
        files.check_writable(str(tmp_path))
    with pytest.raises(InputError, match="is not a directory"):
        files.check_writable(str(tmp_path / "f" / "x.json"))
    with pytest.raises(InputError, match="exists and is not a directory"):
        files.check_writable(str(tmp_path / "f"), directory=True)
    assert files.check_writable(str(tmp_path / "new" / "deeper" / "x.json"))
    assert sorted(os.listdir(tmp_path)) == ["f"]  # the check creates nothing


def test_train_rl_unwritable_out_in_a_real_process_prints_one_line(tiny_world):
    proc = subprocess.run([sys.executable, "-c", "from rlhf_mlflow.cli import cli; cli()", "train-rl",
                           "--world", tiny_world, "--out", UNWRITABLE, *map(str, TINY)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("Error: --out /proc/rlhf-x: cannot write in /proc")
    assert not _runs("train_rl")


def test_certify_out_is_written_before_the_version_is_tagged(tiny_world, tmp_path, monkeypatch):
    """Unwritable: refused before the run. Failing late (a full disk): the run ends FAILED and the
    version keeps no certification tag. Otherwise the file is the logged report."""
    _train(tiny_world)
    _fails(_run("certify", "--model-version", 1, "--world", tiny_world, "--out", UNWRITABLE + ".json"),
           "--out /proc/rlhf-x.json")
    assert not _runs("certify")

    from rlhf_mlflow.steps import certify as certify_step

    def disk_full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", path)
    with monkeypatch.context() as m:
        m.setattr(certify_step, "atomic_write_json", disk_full)
        _fails(_run("certify", "--model-version", 1, "--world", tiny_world, "--out", tmp_path / "cert.json"),
               str(tmp_path / "cert.json"), "No space left on device")
    (run,) = _runs("certify")
    assert run.info.status == "FAILED"
    assert not [k for k in _versions()[0].tags if k.startswith("certification")]
    assert not (tmp_path / "cert.json").exists()

    res = _run("certify", "--model-version", 1, "--world", tiny_world, "--out", tmp_path / "cert.json")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "cert.json").read_text())["subject"]["model_version"] == "1"
    assert "certification.run_id" in _versions()[0].tags


# 3. --out holding another run's files ------------------------------------------------------------

def test_train_rl_refuses_an_out_holding_another_runs_files_unless_overwrite(tiny_world, tmp_path):
    out = tmp_path / "run"
    first = _train(tiny_world, "--out", out, "--save-every", 1, "--steps", 3, "--no-register")
    assert json.loads((out / files.RUN_MARKER).read_text()) == {"command": "train_rl", "run_id": first["run_id"]}
    assert (out / "step_1").is_dir() and (out / "step_2").is_dir()
    before = sorted(os.listdir(out))

    _fails(_run("train-rl", "--world", tiny_world, *TINY, "--out", out),
           f"--out {out}", f"the files of train_rl run {first['run_id']}", "--overwrite")
    assert sorted(os.listdir(out)) == before and len(_runs("train_rl")) == 1

    second = _train(tiny_world, "--out", out, "--overwrite", "--no-register")
    assert json.loads((out / files.RUN_MARKER).read_text()) == {"command": "train_rl", "run_id": second["run_id"]}
    assert not (out / "step_1").exists() and (out / "policy.safetensors").is_file()
    assert [r.info.status for r in _runs("train_rl")] == ["FINISHED", "FINISHED"]
    assert not _leftovers(tmp_path)


def test_train_rl_refuses_an_out_of_unmarked_files(tiny_world, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    _fails(_run("train-rl", "--world", tiny_world, *TINY, "--out", out), "files that no run marked as its own")
    assert os.listdir(out) == ["notes.txt"] and not _runs("train_rl")


def test_overwrite_never_deletes_the_runs_own_inputs(tiny_world, tmp_path):
    world = _copy_world(tiny_world, tmp_path)
    _fails(_run("train-rl", "--world", world, *TINY, "--out", world, "--overwrite"), "is the world")
    assert (world / "policy" / "policy.safetensors").is_file() and not _runs("train_rl")
    old = tmp_path / "old"  # another run's marked directory, holding the policy this run starts from
    files.claim_out_dir(str(old), files.Owner("train_rl", "abc"))
    shutil.copytree(world / "policy", old / "init")
    _fails(_run("train-rl", "--world", world, *TINY, "--policy-init", old / "init", "--out", old, "--overwrite"),
           "contains policy_init")
    assert (old / "init" / "policy.safetensors").is_file() and not _runs("train_rl")


def test_a_run_may_write_into_its_own_out(tmp_path):
    """What --resume will rely on: the directory a run's marker names is free for that run."""
    out = tmp_path / "run"
    files.claim_out_dir(str(out), files.Owner("train_rl", "abc"))
    (out / "step_2").mkdir()
    assert files.check_out_dir(str(out), "train_rl", run_id="abc") == str(out)
    with pytest.raises(InputError, match="the files of train_rl run abc"):
        files.check_out_dir(str(out), "train_rl", run_id="other")


def test_train_rl_overwrite_works_as_mlflow_run_passes_it(tiny_world, tmp_path):
    """`mlflow run -P overwrite=false` passes `--overwrite false`: the flag takes a value too."""
    out = tmp_path / "run"
    _train(tiny_world, "--out", out, "--no-register", "--overwrite", "false")
    _fails(_run("train-rl", "--world", tiny_world, *TINY, "--out", out, "--overwrite", "false"), "--overwrite")
    _train(tiny_world, "--out", out, "--no-register", "--overwrite", "true")


# 4. one validation path for inputs ---------------------------------------------------------------

def _malformed(tmp_path, source: str) -> str:
    """Two good lines of `source`, then a line cut short."""
    lines = open(source).read().splitlines()[:3]
    path = tmp_path / os.path.basename(source)
    path.write_text("\n".join(lines[:2] + [lines[2][:-5]]) + "\n")
    return str(path)


def test_train_rl_malformed_prompt_file_is_named_before_any_run(tiny_world, tmp_path):
    bad = _malformed(tmp_path, os.path.join(tiny_world, "data", "prompts_train.jsonl"))
    _fails(_run("train-rl", "--world", tiny_world, *TINY, "--prompt-file", bad), f"{bad}:3: malformed JSON")
    assert not _runs("train_rl") and not _versions()


@pytest.mark.parametrize("option,source", [("--prompts", "prompts_dev.jsonl"), ("--gold", "gold_calib.jsonl")])
def test_dev_eval_malformed_jsonl_is_named_before_any_run(tiny_world, tmp_path, option, source):
    bad = _malformed(tmp_path, os.path.join(tiny_world, "data", source))
    _fails(_run("dev-eval", "--policy", f"{tiny_world}/policy", "--world", tiny_world, option, bad),
           f"{bad}:3: malformed JSON")
    assert not _runs("dev_eval")


def test_bon_bad_watch_inputs_are_named_before_any_run(tiny_world, tmp_path):
    """`bon --watch-gold` with a malformed expert set, or a correction whose RULES break the schema,
    is one clear error and no bon run."""
    base = ["bon", "--policy", f"{tiny_world}/policy", "--reward-model", f"{tiny_world}/reward_model",
            "--prompts", f"{tiny_world}/data/prompts_dev.jsonl", "--n", 2, "--limit", 4]
    bad = _malformed(tmp_path, os.path.join(tiny_world, "data", "gold_calib.jsonl"))
    _fails(_run(*base, "--watch-gold", bad), f"{bad}:3: malformed JSON")
    correction = tmp_path / "correction.py"
    correction.write_text("RULES = [{'family': 'dune', 'kind': 'tokn', 'token': 'pa', 'bonus': 1.0}]\n"
                          "def transform(records, response_tokens, rewards):\n    return rewards\n")
    _fails(_run(*base, "--watch-gold", f"{tiny_world}/data/gold_calib.jsonl", "--watch-correction", correction),
           f"reward_wrapper {correction}: RULES")
    assert not _runs("bon")


def test_an_unknown_family_names_the_line_and_the_valid_families(tiny_world, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "family": "tundra", "attrs": [0, 0, 0, 0]}\n')
    _fails(_run("train-rl", "--world", tiny_world, *TINY, "--prompt-file", path),
           f"{path}:1: unknown family 'tundra'", "valid families are")


def test_a_world_without_its_dev_prompts_is_named(tiny_world, tmp_path):
    world = _copy_world(tiny_world, tmp_path)
    os.remove(world / "data" / "prompts_dev.jsonl")
    _fails(_run("dev-eval", "--policy", world / "policy", "--world", world),
           f"{world}/data/prompts_dev.jsonl: file not found")
    assert not _runs("dev_eval")


def test_dataset_inputs_are_logged_from_the_validated_records(tiny_world):
    _train(tiny_world, "--no-register")
    (run,) = _runs("train_rl")
    (ds,) = run.inputs.dataset_inputs
    assert ds.dataset.name == "prompts_train.jsonl"
    n = len(D.read_jsonl(os.path.join(tiny_world, "data", "prompts_train.jsonl")))
    assert json.loads(ds.dataset.profile)["num_rows"] == n


def _bad_config(tmp_path, world, which, **changes) -> str:
    src = os.path.join(world, which)
    dst = tmp_path / f"bad_{which}"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("changes,message", [
    ({"d_model": "x"}, "'d_model' must be a positive integer, got 'x'"),
    ({"n_layers": 0}, "'n_layers' must be a positive integer, got 0"),
    ({"n_heads": True}, "'n_heads' must be a positive integer, got True"),
    ({"d_ff": 1.5}, "'d_ff' must be a positive integer, got 1.5"),
    ({"resp_len": 100}, "'resp_len' must be 8 (tokens per response), got 100"),
    ({"prompt_len": 5}, "'prompt_len' must be 6"),
    ({"seq_len": 20}, "'seq_len' must be 14 (prompt_len + resp_len), got 20"),
    ({"vocab_size": 7}, "'vocab_size' must be 40"),
    ({"n_heads": 5}, "'d_model' (64) must be divisible by 'n_heads' (5)"),
])
def test_bad_policy_config_values_are_named(tiny_world, tmp_path, changes, message):
    bad = _bad_config(tmp_path, tiny_world, "policy", **changes)
    with pytest.raises(InputError) as e:
        M.load_policy(bad)
    assert str(e.value).startswith(f"{bad}/config.json: ") and message in str(e.value)


def test_bad_reward_model_config_fails_the_dev_eval_run_cleanly(tiny_world, tmp_path):
    bad = _bad_config(tmp_path, tiny_world, "reward_model", d_model="x")
    _fails(_run("dev-eval", "--policy", f"{tiny_world}/policy", "--world", tiny_world, "--reward-model", bad),
           f"{bad}/config.json: 'd_model' must be a positive integer, got 'x'")
    (run,) = _runs("dev_eval")
    assert run.info.status == "FAILED"


def test_bad_policy_config_fails_train_rl_without_a_version(tiny_world, tmp_path):
    bad = _bad_config(tmp_path, tiny_world, "policy", resp_len=100)
    _fails(_run("train-rl", "--world", tiny_world, *TINY, "--policy-init", bad), "'resp_len' must be 8")
    assert [r.info.status for r in _runs("train_rl")] == ["FAILED"] and not _versions()


@pytest.mark.parametrize("manifest, needle", [
    (None, "no ensemble.json (expected a reward-model ensemble directory)"),
    ('{"members": ["member-0", "../../policy"]}', "is outside the ensemble directory"),
    ('{"members": ["member-0", "member-9"]}', "member-9/config.json: no config.json"),
])
def test_a_bad_reward_ensemble_fails_train_rl_without_a_version(tiny_world, tmp_path, manifest, needle):
    ens = tmp_path / "ens"
    shutil.copytree(os.path.join(tiny_world, "reward_model"), ens / "member-0")
    if manifest is not None:
        (ens / "ensemble.json").write_text(manifest)
    _fails(_run("train-rl", "--world", tiny_world, *TINY, "--reward-ensemble", ens, "--ensemble-penalty", 1.0), needle)
    assert [r.info.status for r in _runs("train_rl")] == ["FAILED"] and not _versions()

def test_a_truncated_safetensors_file_is_a_clean_error(tiny_world, tmp_path):
    bad = tmp_path / "policy"
    shutil.copytree(os.path.join(tiny_world, "policy"), bad)
    data = (bad / "policy.safetensors").read_bytes()
    (bad / "policy.safetensors").write_bytes(data[:len(data) // 2])
    _fails(_run("dev-eval", "--policy", bad, "--world", tiny_world),
           f"{bad}/policy.safetensors: not a readable safetensors file")
    (run,) = _runs("dev_eval")
    assert run.info.status == "FAILED"


# 5. reward-wrapper misuse ------------------------------------------------------------------------

def _wrapper(tmp_path, body: str, name="wrap.py") -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def _apply(path, n=4):
    w = load_wrapper(path)
    records = [{"id": str(i), "family": "dune", "attrs": [0, 1, 2, 3]} for i in range(n)]
    return apply_wrapper(w, path, records, torch.full((n, 8), 30), torch.zeros(n))


@pytest.mark.parametrize("body,message", [
    ("def transform(r, t, rewards):\n    return [[x] for x in rewards]\n",
     "element 0 of transform's result is a list ([0.0]), not a number: return one flat number per response"),
    ("def transform(r, t, rewards):\n    return [True for x in rewards]\n",
     "element 0 of transform's result is a bool (True), not a number"),
    ("def transform(r, t, rewards):\n    return [1.0, 2.0, 'x', 4.0]\n",
     "element 2 of transform's result is str ('x'), not a number"),
    ("def transform(r, t, rewards):\n    return None\n",
     "transform must return a list of numbers, one per response, got NoneType"),
    ("import sys\n\ndef transform(r, t, rewards):\n    sys.exit(3)\n", "transform called sys.exit(3)"),
    ("import sys\nsys.exit(3)\n", "importing it called sys.exit(3)"),
    ("def transform(r, t, rewards):\n    return [x +\n", "failed to import (SyntaxError"),
])
def test_wrapper_misuse_gets_a_precise_message(tmp_path, body, message):
    path = _wrapper(tmp_path, body)
    with pytest.raises(InputError) as e:
        _apply(path)
    assert str(e.value).startswith(f"reward_wrapper {path}: ") and message in str(e.value)


def test_wrapper_outputs_that_are_numbers_pass():
    raw = torch.zeros(3)
    recs = [{"family": "dune", "attrs": [0] * 4}] * 3
    for out in ([1, 2.5, 3], (1.0, 2.0, 3.0), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0]).numpy()):
        got = apply_wrapper(lambda r, t, x: out, "w", recs, torch.full((3, 8), 30), raw)
        assert got.tolist() == pytest.approx([float(v) for v in out])


def test_a_keyboard_interrupt_in_a_wrapper_is_not_swallowed(tmp_path):
    path = _wrapper(tmp_path, "def transform(r, t, rewards):\n    raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        _apply(path)


def test_train_rl_wrapper_returning_lists_fails_its_run(tiny_world, tmp_path):
    path = _wrapper(tmp_path, "def transform(r, t, rewards):\n    return [[x] for x in rewards]\n")
    _fails(_run("train-rl", "--world", tiny_world, *TINY, "--reward-wrapper", path),
           f"reward_wrapper {path}: element 0 of transform's result is a list")
    assert [r.info.status for r in _runs("train_rl")] == ["FAILED"] and not _versions()


def test_train_rl_wrapper_calling_sys_exit_is_an_error_not_a_silent_exit(tiny_world, tmp_path):
    path = _wrapper(tmp_path, "import sys\n\ndef transform(r, t, rewards):\n    sys.exit(3)\n")
    _fails(_run("train-rl", "--world", tiny_world, *TINY, "--reward-wrapper", path),
           f"reward_wrapper {path}: transform called sys.exit(3)")
    assert [r.info.status for r in _runs("train_rl")] == ["FAILED"] and not _versions()


def test_a_wrapper_exiting_at_import_in_a_real_process_prints_one_line(tiny_world, tmp_path):
    path = _wrapper(tmp_path, "import sys\nsys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", "from rlhf_mlflow.cli import cli; cli()", "train-rl",
                           "--world", tiny_world, "--reward-wrapper", path, *map(str, TINY)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"Error: reward_wrapper {path}: importing it called sys.exit(3)"
    assert not _runs("train_rl")


# 6. provenance: the bytes executed are the bytes hashed ------------------------------------------

def test_a_loaded_wrapper_is_the_bytes_it_hashed(tmp_path):
    path = _wrapper(tmp_path, "def transform(r, t, rewards):\n    return [x + 1.0 for x in rewards]\n")
    w = load_wrapper(path)
    source = open(path, "rb").read()
    open(path, "w").write("def transform(r, t, rewards):\n    return [x - 100.0 for x in rewards]\n")
    assert isinstance(w, RewardWrapper) and w.path == path
    assert w.sha256 == hashlib.sha256(source).hexdigest() == hashlib.sha256(w.source).hexdigest()
    assert w.transform(None, None, [1.0]) == [2.0]  # what was hashed, not what is on disk now


def test_train_rl_and_certify_record_the_executed_files_hash(tiny_world, tmp_path):
    text = "def transform(r, t, rewards):\n    return [x + 0.5 for x in rewards]\n"
    path = _wrapper(tmp_path, text)
    sha = hashlib.sha256(text.encode()).hexdigest()
    summary = _train(tiny_world, "--reward-wrapper", path)
    run = mlflow.get_run(summary["run_id"])
    assert run.data.params["reward_wrapper_sha256"] == sha
    local = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="reward_wrapper/wrap.py",
                                                dst_path=str(tmp_path / "dl"))
    assert open(local).read() == text
    version = _versions()[0]
    assert version.run_id == run.info.run_id  # the version's run, whose params hold the wrapper's sha256

    res = _run("certify", "--model-version", version.version, "--world", tiny_world, "--correction", path)
    assert res.exit_code == 0, res.output
    (cert,) = _runs("certify")
    assert cert.data.params["correction_sha256"] == sha
    # the version names the certify run whose parameters hold the correction's sha256
    assert mlflow.MlflowClient().get_model_version("rlhf-policy", version.version).tags["certification.run_id"] == \
        cert.info.run_id


@pytest.mark.parametrize("args,message", [
    (["--guardrail", "max_kl=3"], "unknown guardrail key 'max_kl'"),
    (["--guardrails", "min_balanced_gain=nan"], "min_balanced_gain must be a number in [-1, 1], got nan"),
    (["--steps-scale", "0"], "--steps-scale must be a number in (0, 50], got 0.0"),
])
def test_main_refuses_bad_options_before_any_run(tiny_world, tmp_path, args, message):
    res = CliRunner().invoke(cli, ["main", "--world", tiny_world, "--out", str(tmp_path / "out"), *args])
    assert res.exit_code == 1 and message in res.output, res.output
    assert not mlflow.search_runs(search_all_experiments=True, output_format="list")
