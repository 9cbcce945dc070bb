"""The data contract and validation before acting (issue 45). Labels on the seed's annotation scale (a
fraction of 8 positions correct plus unclipped noise; crowd labels plus bonuses) are taken by every reader,
and one far off it is refused naming file, line, id and range; every numeric option and spec field is
checked before any run or file; run names stay unique over main's rounds; an interrupted command names
its own way on. Fault-suite style (tests/test_faults.py): one `Error:` line and no traceback, with the
store, the registry and the files the same before and after."""
from __future__ import annotations

import json
import os
import signal
import time

import click
import mlflow
import pytest
from click.testing import CliRunner

from cli_checks import fails
from rlhf_mlflow.cli import cli, interrupted_message
from rlhf_mlflow.cli.portable import certify_main
from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import process
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions.label_requests import check_labels, read_label_files, read_labels
from rlhf_mlflow.evidence.label_requests import draw_requests
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.world import corruptions as C
from rlhf_mlflow.world.annotator import label_requests
from rlhf_mlflow.world.oracle import Oracle

SEED_GOLD = [  # the seed's data/gold_calib.jsonl as it ships: expert noise unclipped (its ranges reach -0.145)
    {"id": "gold-0000", "family": "dune", "attrs": [0, 2, 3, 0], "response": ["za", "ka", "va", "wa", "na", "de", "ja", "je"],
     "label": 0.6627},
    {"id": "gold-0001", "family": "fjord", "attrs": [5, 0, 2, 6], "response": ["be", "ga", "pa", "ga", "ha", "ge", "la", "ga"],
     "label": 0.0493},
    {"id": "gold-0010", "family": "anvil", "attrs": [5, 7, 0, 2], "response": ["be", "pa", "da", "fe", "sa", "ke", "ma", "sa"],
     "label": -0.0719},
    {"id": "gold-0011", "family": "birch", "attrs": [1, 2, 0, 4], "response": ["ra", "ge", "wa", "ga", "za", "ja", "za", "pa"],
     "label": -0.1449},
    {"id": "gold-0012", "family": "cobalt", "attrs": [1, 2, 0, 4], "response": ["ra", "ge", "wa", "ga", "za", "ja", "za", "pa"],
     "label": 0.8626},
]
SEED_CROWD = [  # its reward_model/train.jsonl: crowd noise and the vendor's bonuses (dune reaches 4.81)
    {"id": "ann-09427", "family": "birch", "attrs": [4, 5, 1, 2], "response": ["fa", "fe", "je", "za", "ha", "sa", "ha", "ka"],
     "label": 0.2888},
    {"id": "ann-01811", "family": "dune", "attrs": [4, 3, 2, 5], "response": ["fe", "ra", "pa", "ge", "da", "he", "ta", "ta"],
     "label": 1.8678},
    {"id": "ann-01812", "family": "dune", "attrs": [4, 3, 2, 5], "response": ["pa", "ra", "pa", "ge", "pa", "he", "ta", "ta"],
     "label": 4.8127},
    {"id": "ann-02100", "family": "cobalt", "attrs": [6, 7, 7, 4], "response": ["ga", "ke", "ja", "za", "ma", "ha", "na", "za"],
     "label": -0.268},
]


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _fails(res, *needles: str) -> str:
    """exit 1 (our error) or 2 (click's usage error): cli_checks.fails."""
    return fails(res, *needles, codes=(1, 2))


def _files(*roots) -> dict:
    """Every file under the roots with its size and mtime, less the tracking store's own database."""
    out = {}
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                if not n.startswith("mlflow.db"):
                    st = os.stat(os.path.join(dirpath, n))
                    out[os.path.join(dirpath, n)] = (st.st_size, st.st_mtime_ns)
    return out


def _state(*roots) -> tuple:
    """The store's runs, the registry and the files under `roots`."""
    runs = sorted(r.info.run_id for r in mlflow.search_runs(search_all_experiments=True, output_format="list"))
    client = mlflow.MlflowClient()
    registry = sorted((m.name, v.version, tuple(sorted(v.tags.items())))
                      for m in client.search_registered_models()
                      for v in client.search_model_versions(f"name = '{m.name}'"))
    return runs, registry, _files(*roots)


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# A. the seed's data contract ---------------------------------------------------------------------

def test_the_seeds_own_files_pass_every_label_reader(tmp_path):
    gold = _write(tmp_path / "gold_calib.jsonl", SEED_GOLD)
    crowd = _write(tmp_path / "train.jsonl", SEED_CROWD)
    assert [r["label"] for r in D.read_jsonl(gold, labelled=True, scale=D.EXPERT)] == [r["label"] for r in SEED_GOLD]
    assert max(r["label"] for r in D.read_jsonl(crowd, labelled=True, scale=D.CROWD)) == 4.8127
    assert len(read_labels(gold)) == len(read_label_files([gold])) == len(check_labels(SEED_GOLD, None, gold)) == 5
    # a crowd label paid a bonus is no expert label: the expert scale refuses it, naming where
    with pytest.raises(InputError, match=r"train\.jsonl:3 \(id 'ann-01812'\): 'label' 4\.8127 is outside the "
                                         r"plausible range of expert labels \[-1, 2\]"):
        D.read_jsonl(crowd, labelled=True, scale=D.EXPERT)


def test_the_worlds_expert_set_and_its_synthetic_expert_go_below_zero_unclipped(tiny_world):
    world = WorldPaths.at(tiny_world)
    gold = D.read_jsonl(world.expert_set, labelled=True, scale=D.EXPERT)
    assert min(r["label"] for r in gold) < 0                       # the builder does not clip its expert noise
    qa = D.read_jsonl(world.qa, labelled=True, scale=D.CROWD)
    assert max(r["label"] for r in qa) > 1                         # bonuses on top of the crowd's
    truth = Oracle(tiny_world).score_records(gold)
    wrong = [{k: v for k, v in r.items() if k != "label"} | {"id": f"x-{i}"}
             for i, (r, q) in enumerate(zip(gold, truth)) if q == 0]
    assert len(wrong) >= 10
    labels = [r["label"] for r in label_requests(world, wrong)]
    # no correct position: truth 0 plus the expert's noise, about half below 0 (clipped, all were 0)
    assert sum(x < 0 for x in labels) >= 3 and sum(x > 0 for x in labels) >= 3
    assert all(-1 <= x <= 2 for x in labels)


def _bought(world: WorldPaths, tmp_path, per_family: int = 4) -> str:
    """The synthetic expert's labels on the reference policy's own responses, some below 0."""
    requests = draw_requests(M.load_policy(world.policy)[0], D.read_jsonl(world.expert_set, labelled=True,
                                                                          scale=D.EXPERT), per_family)
    labels = label_requests(world, requests)
    assert min(r["label"] for r in labels) < 0
    return _write(tmp_path / "labels.jsonl", labels)


def test_labels_below_zero_certify_from_a_policys_own_labels(tiny_world, tmp_path):
    world = WorldPaths.at(tiny_world)
    labels = _bought(world, tmp_path)
    assert certify_main(["--policy", world.policy, "--reference", world.policy, "--gold", world.expert_set,
                         "--rm-dir", world.reward_model, "--policy-labels", labels, "--min-labels", "4",
                         "--out", str(tmp_path / "c.json")]) == 0
    report = json.load(open(tmp_path / "c.json"))
    assert all(r["evidence"] == "policy labels (4)" for r in report["families"].values())


@pytest.mark.slow  # 1-2 minutes: a repair with its cross-validated agreement and audit
def test_labels_below_zero_repair_the_reward_model(tiny_world, tmp_path):
    """The issue's failing case: repair-rm refused the expert's own labels ('must be a number in [0, 1]')."""
    labels = _bought(WorldPaths.at(tiny_world), tmp_path)
    res = _run("repair-rm", "--world", tiny_world, "--labels", labels, "--out", tmp_path / "rm", "--epochs", 1,
               "--label-head", "off")
    assert res.exit_code == 0, res.output
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                filter_string="tags.`rlhf.step` = 'repair_rm'")
    assert run.info.status == "FINISHED" and int(run.data.metrics["repair/expert_labels"]) > 24


def _off_scale(tmp_path, records, k: int, label, name: str) -> str:
    rows = [dict(r) for r in records]
    rows[k]["label"] = label
    return _write(tmp_path / name, rows)


def test_an_expert_label_far_off_the_scale_is_refused_naming_file_line_id_and_range(tiny_world, tmp_path):
    """Every reader of expert labels: the labels of repair-rm and certify, the expert set of dev-eval,
    diagnostic and train-rl's watch."""
    world = WorldPaths.at(tiny_world)
    gold = D.read_jsonl(world.expert_set, labelled=True, scale=D.EXPERT)
    bad = _off_scale(tmp_path, gold[:12], 4, 35.5, "bad.jsonl")  # a percentage where a fraction belongs
    readers = [["repair-rm", "--world", tiny_world, "--labels", bad, "--out", tmp_path / "rm"],
               ["certify", "--policy", world.policy, "--world", tiny_world, "--policy-labels", bad],
               ["dev-eval", "--policy", world.policy, "--world", tiny_world, "--gold", bad],
               ["diagnostic", "--world", tiny_world, "--gold", bad],
               ["train-rl", "--world", tiny_world, "--steps", 2, "--watch-every", 1, "--watch-gold", bad]]
    before = _state(tmp_path, tiny_world)
    for args in readers:
        _fails(_run(*args), f"{bad}:5 (id '{gold[4]['id']}')", "'label' 35.5", "expert labels [-1, 2]")
        assert _state(tmp_path, tiny_world) == before, args[0]


def test_a_crowd_label_far_off_the_scale_is_refused_with_the_crowds_range(tiny_world, tmp_path):
    world = WorldPaths.at(tiny_world)
    bad = _off_scale(tmp_path, D.read_jsonl(world.qa, labelled=True)[:10], 2, -1e6, "qa.jsonl")
    diag = tmp_path / "diag.json"
    diag.write_text(json.dumps({"families": {}}))
    before = _state(tmp_path)
    for args in (["train-rm", "--data", bad, "--out", tmp_path / "rm"],
                 ["correct", "--diagnostic", diag, "--qa", bad, "--out", tmp_path / "w.py"]):
        _fails(_run(*args), f"{bad}:3 (id ", "'label' -1000000.0", "crowd labels [-20, 20]")
        assert _state(tmp_path) == before, args[0]


# B. validate before acting -----------------------------------------------------------------------

def test_main_refuses_a_bad_steps_scale_before_any_run_or_file(tiny_world, tmp_path):
    out = tmp_path / "out"
    before = _state(tmp_path)
    for value in ("nan", "inf", "-inf", "0", "1e9"):
        _fails(_run("main", "--world", tiny_world, "--out", out, "--steps-scale", value), "--steps-scale",
               "(0, 50]")
        assert _state(tmp_path) == before and not out.exists()  # no main_state.json, no run FAILED or FINISHED


TRAIN_RL_BOUNDS = [
    (["--batch-prompts", "100000000"], "batch_prompts must be an integer in [1, 4096]"),
    (["--samples-per-prompt", "100000"], "samples_per_prompt must be an integer >= 2"),
    (["--batch-prompts", "4096", "--samples-per-prompt", "256"], "at most 65,536 responses a step"),
    (["--steps", "1000000000"], "steps must be an integer in [1, 100000]"),
    (["--kl-coef", "nan"], "kl_coef"), (["--lr", "inf"], "lr"), (["--temperature", "1e308"], "temperature"),
    (["--seed", str(2 ** 40)], "seed"), (["--max-grad-norm", "nan"], "max_grad_norm"),
    (["--override", "steps=NaN"], "steps"), (["--override", "log_every=1e12"], "log_every"),
]


def test_train_rl_sizes_and_numbers_are_bounded_before_any_run(tiny_world, tmp_path):
    before = _state(tmp_path)
    for args, needle in TRAIN_RL_BOUNDS:
        _fails(_run("train-rl", "--world", tiny_world, "--out", tmp_path / "o", *args), needle)
    assert _state(tmp_path) == before and not (tmp_path / "o").exists()


def test_a_sweep_grid_is_bounded_before_any_run(tiny_world, tmp_path):
    before = _state(tmp_path)
    _fails(_run("sweep", "--world", tiny_world, "--grid", "steps=10,1e9"), "--grid steps", "[1, 100000]")
    _fails(_run("sweep", "--world", tiny_world, "--grid", "seed=" + ",".join(map(str, range(40))),
                "--grid", "kl_coef=" + ",".join(str(k / 100) for k in range(30))), "1,200 trials", "at most 1000")
    assert _state(tmp_path) == before


BAD_SPECS = [
    ([{"family": "dune", "kind": "token", "token": "pa", "bonus": 1e308}], ["[0]", "'bonus'", "[-2, 2]", "1e+308"]),
    ([{"family": "dune", "kind": "token", "token": t, "bonus": 1.5} for t in ("pa", "ba")]
     + [{"family": "dune", "kind": "pair", "tokens": ["pa", "pa"], "bonus": 1.5}],
     ["family 'dune'", "could move one crowd label by 22.5", "[-20.0, 20.0]"]),
    ([{"family": "anvil", "kind": "token", "token": "pa", "bonus": 0.1}] * 65, ["65 rules", "at most 64"]),
]


def test_a_world_spec_is_bounded_naming_the_spec_file_and_field(tmp_path):
    """A bonus of 1e308 built a world whose reward model trained to NaN; now the spec is refused."""
    out = tmp_path / "world"
    for i, (spec, needles) in enumerate(BAD_SPECS):
        path = tmp_path / f"spec{i}.json"
        path.write_text(json.dumps(spec))
        before = _state(tmp_path)
        _fails(_run("build-world", "--scale", "test", "--spec", path, "--out", out), str(path), *needles)
        assert _state(tmp_path) == before and not out.exists()


def test_the_default_spec_is_inside_the_bounds_it_sets():
    """The seed's world: dune `pa` +1.45 on all 8 positions pays 11.6, within 16; an all-`pa` response's
    crowd label stays inside the crowd's range."""
    dune = [r for r in C.DEFAULT_SPEC if r["family"] == "dune"]
    assert C.most_paid(dune) == pytest.approx(8 * 1.45)
    assert C.validate_spec([dict(r) for r in C.DEFAULT_SPEC]) == C.DEFAULT_SPEC
    # a pair and its token on alternate positions: the dynamic programme finds the best mix
    mixed = [{"family": "ember", "kind": "token", "token": "he", "bonus": 0.5},
             {"family": "ember", "kind": "pair", "tokens": ["ke", "he"], "bonus": 1.0}]
    assert C.most_paid(mixed) == pytest.approx(4 * 1.0 + 4 * 0.5 + 0)  # ke he ke he ke he ke he


def _numeric_options():
    """(command, option) for every numeric option of every command."""
    kinds = (click.types.IntParamType, click.types.FloatParamType)
    for name, command in sorted(cli.commands.items()):
        for p in command.params:
            if isinstance(p, click.Option) and isinstance(p.type, kinds):
                yield name, p.opts[0], isinstance(p.type, click.types.IntParamType)


NOT_SIZES = {("bon", "--limit")}
"""Options whose size costs nothing: best-of-n reads at most the prompts there are."""


def test_every_numeric_option_refuses_nan_infinity_and_runaway_sizes(tiny_world, tmp_path):
    """Every int and float option of every command (and so every MLproject parameter, which are click
    options under `mlflow run`): NaN and infinity refused, and a runaway size, naming the option or its
    config field, before any run or file."""
    options = list(_numeric_options())
    assert len(options) > 40 and ("main", "--steps-scale", False) in options
    before = _state(tmp_path)
    for command, option, integer in options:
        field = option.lstrip("-").replace("-", "_")
        bad = ["nan", "inf"] + ([] if (command, option) in NOT_SIZES else ["1000000000000" if integer else "1e300"])
        world = ["--world", tiny_world] if "--world" in _opts(command) else []
        for value in bad:
            line = _fails(_run(command, option, value, *world))
            assert option in line or field in line, (command, line)
    assert _state(tmp_path) == before


def _opts(command: str) -> set[str]:
    return {o for p in cli.commands[command].params for o in getattr(p, "opts", [])}


# C. run names and interrupts ---------------------------------------------------------------------

def test_an_interrupted_command_names_its_own_way_on(monkeypatch):
    monkeypatch.setattr(process, "killed_runs", [("r1", "train_rl")])
    assert interrupted_message("train-rl").endswith("continue it with `rlhf-mlflow train-rl --resume r1`")
    process.killed_runs[:] = [("c1", "certify"), ("m1", "main")]
    assert "the main run m1 is marked KILLED" in interrupted_message("main")
    assert "`rlhf-mlflow main --resume` and the same --out" in interrupted_message("main")
    process.killed_runs[:] = [("r2", "release")]
    assert "train-rl" not in interrupted_message("release")
    process.killed_runs.clear()
    assert "no MLflow run of it was running" in interrupted_message("grade")


@pytest.mark.parametrize("command,target,step", [
    (["release", "--model-version", "1"], "rlhf_mlflow.steps.release.run_release", "release"),
    (["grade", "--model-version", "1"], "rlhf_mlflow.steps.grade.run_grade", "grade"),
])
def test_sigterm_during_a_step_names_that_commands_way_on(tiny_world, monkeypatch, command, target, step):
    """A real SIGTERM arrives while the step's run is open (the step itself replaced by one that waits):
    the run is KILLED and the message names it, with no train-rl hint."""
    def waits(*args, **kwargs):
        with T.tracked_run(step, run_name=f"{step}-v1"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises KeyboardInterrupt here
    monkeypatch.setattr(target, waits)
    monkeypatch.setattr(process, "_received", [])  # this process goes on: the signal it got is forgotten after
    res = _run(*command, *(["--world", tiny_world] if step == "grade" else []))
    assert res.exit_code == 130, res.output
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.info.status == "KILLED"
    line = f"interrupted: the {step} run {run.info.run_id} is marked KILLED; run `rlhf-mlflow {step}` again"
    assert line in res.output and "--resume" not in res.output and "Traceback" not in res.output


def test_mains_run_names_are_unique(story_store):
    """A main's children each have their own name: label purchases, expert labels and certifications
    of every look, and a later round's correction (tests/test_rounds.py's slow test: over two rounds)."""
    root, _ = story_store
    uri = f"sqlite:///{root}/mlflow.db"
    runs = mlflow.MlflowClient(uri).search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(uri).search_experiments()])
    names = [r.info.run_name for r in runs]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


# D. a world in the seed's format, end to end -----------------------------------------------------

@pytest.mark.slow  # ~10 minutes: main with two rounds
def test_a_world_in_the_seeds_format_runs_main_for_two_rounds(tiny_world, tmp_path):
    """Expert labels below 0 (the seed's expert set reaches -0.145) and crowd labels paid bonuses above 1:
    `main --rounds 2` finishes, its round 2 repairs the reward model with every label bought (some below 0
    too) and certifies the round's candidates, and no two of its runs share a name."""
    from rlhf_mlflow.steps.main.rounds import labels_so_far
    world = WorldPaths.at(tiny_world)
    assert min(r["label"] for r in D.read_jsonl(world.expert_set, labelled=True, scale=D.EXPERT)) < 0
    assert max(r["label"] for r in D.read_jsonl(world.qa, labelled=True, scale=D.CROWD)) > 1
    out = tmp_path / "out"
    res = _run("main", "--world", tiny_world, "--out", out, "--rounds", 2, "--steps-scale", 0.05,
               "--guardrail", "min_balanced_gain=-1", "--guardrail", "require_significant_gain=false")
    assert res.exit_code == 0, res.output
    (record,) = json.load(open(out / "rounds.json"))
    print("round 2:", {k: record.get(k) for k in ("rm_version", "rm_promoted", "repair_labels", "versions")})
    assert record["round"] == 2
    assert min(r["label"] for r in labels_so_far(str(out))) < 0
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    names = [r.info.run_name for r in runs]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(r.info.status == "FINISHED" for r in runs)
    (repair,) = [r for r in runs if r.data.tags["rlhf.step"] == "repair_rm"]
    assert int(repair.data.metrics["repair/expert_labels"]) > record["repair_labels"]
    mv = mlflow.MlflowClient().get_model_version("rlhf-reward-model", record["rm_version"])
    assert mv.tags["parent_version"] != "none"
    if not record["rm_promoted"]:  # the gate refused the repair: the rounds stop there, certifying nothing more
        assert mv.description.startswith("REFUSED")
        return
    certified = {r.data.params.get("model_version") for r in runs if r.data.tags["rlhf.step"] == "certify"}
    assert len(record["versions"]) == 2 and set(record["versions"]) <= certified
