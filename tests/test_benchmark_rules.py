"""The pure parts of the speed benchmarks (benchmarks/paired.py, machine_load.py, ab.py,
step_composition.py): the order arms run in, per-repeat ratios and what is quoted of them, the verdict and the
busy rule, /proc/stat read from a fake text, a worker's CPU read from /proc, what the targets need of a
step; and RLHF_PARTNER, the switch for train_rl's partner process. No timing is asserted."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    """A benchmarks/ module, loaded by path (benchmarks/ is not on the test's import path)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


paired, machine_load = _load("paired"), _load("machine_load")

STAT = """cpu  1000 50 200 5000 30 0 10 40 0 0
cpu0 500 25 100 2500 15 0 5 20 0 0
intr 12345
"""


def test_each_repeat_runs_every_arm_in_a_rotating_order():
    assert [paired.order("ABC", r) for r in range(4)] == [list("ABC"), list("BCA"), list("CAB"), list("ABC")]
    assert [paired.order(["A", "B"], r) for r in range(3)] == [["A", "B"], ["B", "A"], ["A", "B"]]


def test_ratios_are_per_repeat_then_median_and_range():
    rates = {"seed": [10.0, 2.0, 8.0], "ours": [30.0, 20.0, 24.0]}
    s = paired.summarise(paired.ratios(rates, "ours", "seed"))
    assert s.ratios == [3.0, 10.0, 3.0] and (s.median, s.lo, s.hi) == (3.0, 3.0, 10.0)
    assert str(s) == "median 3.00, range 3.00-10.00 (repeats 3.00, 10.00, 3.00)"
    with pytest.raises(ValueError, match="--repeats"):
        paired.summarise([])


def test_the_verdict_is_withheld_when_a_repeat_was_busy_or_a_run_failed():
    s = paired.summarise([2.9, 3.1, 3.2])
    assert paired.verdict(s, [], 3.0) == "met (median 3.10 >= 3)"
    assert paired.verdict(s, [], 3.5) == "not met (median 3.10 < 3.5)"
    assert paired.verdict(s, [2], 3.0) == "none: machine busy (repeats 2)"
    assert paired.verdict(s, [2], 3.0, failed=[1]) == "none: failed runs (repeats 1)"
    assert paired.verdict(paired.summarise([1.05, 1.2]), [], 1.1, higher_is_better=False) == \
        "not met (median 1.12 > 1.1)"
    assert paired.verdict(s, [], None) == "above 1 in every repeat"
    assert paired.verdict(paired.summarise([0.8, 0.9]), [], None) == "below 1 in every repeat"
    assert paired.verdict(paired.summarise([0.9, 1.1]), [], None).startswith("none: the repeats disagree")
    assert paired.busy_repeats([[], ["load 3.1 before > 2.5"], []]) == [2]


def test_proc_stat_is_read_into_busy_and_steal_ticks():
    assert machine_load.parse_proc_stat(STAT) == machine_load.CpuTicks(busy=1000 + 50 + 200 + 0 + 10, steal=40)
    assert machine_load.parse_proc_stat("cpu  1 2 3 4\n") == machine_load.CpuTicks(busy=6, steal=0)  # old kernel
    assert machine_load.parse_proc_stat("intr 1\n") is None
    assert machine_load.parse_proc_stat("cpu  1 x 3\n") is None


def test_steal_and_others_are_shares_of_the_run_across_all_cpus():
    before = machine_load.Mark(10.0, 1.0, machine_load.CpuTicks(busy=1000, steal=40))
    after = machine_load.Mark(12.0, 1.5, machine_load.CpuTicks(busy=1300, steal=60))
    # 2 s on 2 CPUs at 100 ticks/s: 20 ticks of steal of 400 = 5%; 3.0 busy CPU-seconds, 2.0 of them ours
    g = machine_load.between(before, after, own_cpu_s=2.0, cpus=2, hz=100)
    assert (g.load_before, g.load_after) == (1.0, 1.5)
    assert g.steal == pytest.approx(0.05) and g.others == pytest.approx(0.5)
    assert machine_load.describe(g) == "load 1.00->1.50, steal 5.0%, others 0.50 CPUs"
    short = machine_load.Mark(10.1, 1.5, after.cpu)  # a tenth of a second: ticks cannot tell
    assert machine_load.between(before, short, 0.0, cpus=2, hz=100).others is None


def test_the_busy_rule():
    quiet = machine_load.Load(3.3, 3.2, 0.01, 0.1)  # a lagging load average alone does not make a run busy
    assert machine_load.busy_reasons(quiet, threads=2) == []
    busy = machine_load.Load(1.0, 1.1, 0.06, 0.3)
    assert machine_load.busy_reasons(busy, threads=2) == ["others 0.30 CPUs > 0.25", "steal 6.0% > 5%"]
    short = machine_load.Load(2.6, 2.4, None, None)  # no others figure: the load average decides
    assert machine_load.busy_reasons(short, threads=2) == ["load 2.60 before > 2.5"]
    unknown = machine_load.Load(None, None, None, None)
    assert machine_load.busy_reasons(unknown, threads=1) == []
    assert machine_load.describe(unknown) == "load n/a->n/a, steal n/a, others n/a"
    assert machine_load.span([quiet, busy]) == "load 1.00-3.30, steal <= 6.0%, others <= 0.30 CPUs"


def test_ab_takes_two_commands_after_double_dashes(capsys):
    ab = _load("ab")
    assert ab.split_commands(["--repeats", "3", "--", "sleep 1", "--", "python", "-c", "print(1)"]) == \
        (["--repeats", "3"], ["sleep 1", "python -c 'print(1)'"])
    ab.main(["--repeats", "2", "--warmup", "0", "--", "true", "--", "exit 3"])
    out = capsys.readouterr().out.strip().splitlines()
    assert [x.split(":")[0].strip() for x in out if x.strip().startswith("repeat 2 ")][:2] == ["repeat 2 B", "repeat 2 A"]
    assert out[-1] == "verdict: none: failed runs (repeats 1, 2)"


def test_rlhf_partner_switches_the_partner_process_off(monkeypatch):
    from rlhf_mlflow.training import two_process_step as partner
    monkeypatch.setattr(partner.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(partner.sys, "platform", "linux")
    for value, expected in (("", True), ("auto", True), ("on", True), ("OFF", False), ("off", False)):
        monkeypatch.setenv("RLHF_PARTNER", value)
        assert partner.available(2, 16) is expected, value
    monkeypatch.delenv("RLHF_PARTNER")
    assert partner.available(2, 16) and not partner.available(1, 16)
    monkeypatch.setenv("RLHF_PARTNER", "sometimes")
    with pytest.raises(ValueError, match="RLHF_PARTNER='sometimes': expected one of auto, on, off"):
        partner.available(2, 16)


def test_a_worker_process_cpu_is_read_from_proc():
    """batched_2w's workers are not reaped children: their CPU seconds come from /proc/<pid>/stat, or the
    busy rule would count the benchmark's own workers as other load."""
    t = os.times()
    end = t.user + t.system + 0.3
    while sum(os.times()[:2]) < end:  # burn CPU so that there is something to read
        pass
    read = machine_load.process_cpu_seconds(os.getpid())
    assert abs(read - sum(os.times()[:2])) < 0.1
    assert machine_load.process_cpu_seconds(2 ** 22 + 7) == 0.0  # no such process


def test_step_composition_says_what_the_rest_must_shrink_to():
    comp = _load("step_composition")
    assert comp.shrink(rest=10.0, products=5.0, budget=10.0) == "the rest must shrink 2.0x"
    assert comp.shrink(rest=10.0, products=12.0, budget=10.0).startswith("out of reach")
    lines = comp.requirements([(1, 30.0, 10.0), (8, 20.0, 10.0)], seed=20.0, partner_gain=1.5)
    # one run, 3x = 60 steps/s: two cores fully used give 33.3 ms per one-core step, the partner's 1.5x 25 ms
    assert lines[0].startswith("one run, 3.0x = 60.0 steps/s")
    assert "shrink 0.9x" in lines[0] and "shrink 1.3x" in lines[0]
    # batched, 5x = 100 policy-steps/s on two cores: 20 ms per policy-step per core; only N > 1 is listed
    assert lines[1].startswith("batched, 5.0x = 100.0") and "N 8: the rest must shrink 1.0x" in lines[1]
    assert "N 1:" not in lines[1]
