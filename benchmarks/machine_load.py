"""How busy the machine was around one timed run: the 1-min load average before and after it, the CPU
steal during it, and the CPU time other processes used during it; and the one rule that calls a run
busy. Shared by benchmarks/train_rl_speed.py (arms inside one process) and benchmarks/ab.py (whole
processes). Steal and others come from Linux's /proc/stat; elsewhere only the load average decides.

Why the rule uses the CPUs others used and not the load average: "others" is the direct figure, the
machine's busy CPU time during the run minus the run's own (this process and its reaped children, or
the command's), in CPUs (0.5: half a CPU on average), and it is what a run loses to other work. The
1-min load average is a moving average that lags by a minute and counts the run's own threads: on
2026-12-05 it stayed at 2.9-3.3 (over 2 threads + 0.5) for two repeats after another job had ended,
while others used 0.00-0.05 CPUs and the arms ran at their quiet speed; and it misses a job that
starts during a run. It is printed, and it decides only where "others" cannot be measured (no
/proc/stat, or a run under MIN_WALL). Steal is time the hypervisor gave our virtual CPUs to another
guest; it counts separately.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

# The busy rule: a run is busy when others used more than BUSY_OTHERS CPUs during it, or steal exceeded
# BUSY_STEAL of it; where others cannot be measured, when the 1-min load before or after it exceeds the
# benchmark's own threads + BUSY_LOAD_MARGIN.
BUSY_OTHERS = 0.25
"""other processes used more than this many CPUs on average during the run"""
BUSY_STEAL = 0.05
"""CPU steal during the run exceeds this fraction of its wall time across all CPUs"""
BUSY_LOAD_MARGIN = 0.5
"""only without an `others` figure: the 1-min load exceeds the benchmark's own threads by more than this"""
MIN_WALL = 0.5
"""runs shorter than this (seconds) get no steal or others figure: /proc/stat counts in clock ticks"""


@dataclass(frozen=True)
class CpuTicks:
    """The aggregate `cpu` line of /proc/stat, in clock ticks since boot."""
    busy: int
    """user + nice + system + irq + softirq (guest time is already inside user and nice)"""
    steal: int
    """time our virtual CPUs were ready to run but the hypervisor ran another guest"""


def parse_proc_stat(text: str) -> CpuTicks | None:
    """The aggregate CPU ticks of a /proc/stat text; None when it has no well-formed `cpu` line."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            try:
                v = [int(x) for x in fields[1:]] + [0] * 8  # old kernels print fewer columns
            except ValueError:
                return None
            user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
            return CpuTicks(busy=user + nice + system + irq + softirq, steal=steal)
    return None


@dataclass(frozen=True)
class Mark:
    """The machine at one instant."""
    wall: float
    load1: float | None
    cpu: CpuTicks | None


def mark() -> Mark:
    """The machine now."""
    try:
        with open("/proc/stat") as f:
            cpu = parse_proc_stat(f.read())
    except OSError:
        cpu = None
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = None
    return Mark(time.perf_counter(), load1, cpu)


def own_cpu_seconds() -> float:
    """User + system seconds of this process and its reaped children (a partner process counts once
    it has been joined)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (a child not yet reaped, such as a pool's worker), from
    /proc/<pid>/stat; 0.0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # after the command's closing parenthesis: state is field 3, utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Load:
    """The machine around one run."""
    load_before: float | None
    load_after: float | None
    steal: float | None
    """fraction of the run's wall time across all CPUs"""
    others: float | None
    """CPUs other processes used on average during the run"""


def between(before: Mark, after: Mark, own_cpu_s: float, cpus: int | None = None, hz: int | None = None) -> Load:
    """The Load of a run between two marks that itself used `own_cpu_s` CPU seconds."""
    cpus = cpus or os.cpu_count() or 1
    hz = hz or os.sysconf("SC_CLK_TCK")
    wall = after.wall - before.wall
    steal = others = None
    if before.cpu and after.cpu and wall >= MIN_WALL:
        steal = (after.cpu.steal - before.cpu.steal) / hz / (wall * cpus)
        others = min(cpus, max(0.0, (after.cpu.busy - before.cpu.busy) / hz - own_cpu_s) / wall)
    return Load(before.load1, after.load1, steal, others)


def busy_reasons(load: Load, threads: int) -> list[str]:
    """Why a run counts as busy under the rule above (empty: it was quiet enough). `threads`: the
    benchmark's own threads (or processes), which the load average counts while it runs."""
    out = []
    if load.others is not None and load.others > BUSY_OTHERS:
        out.append(f"others {load.others:.2f} CPUs > {BUSY_OTHERS}")
    if load.steal is not None and load.steal > BUSY_STEAL:
        out.append(f"steal {100 * load.steal:.1f}% > {100 * BUSY_STEAL:.0f}%")
    if load.others is None:
        limit = threads + BUSY_LOAD_MARGIN
        out += [f"load {value:.2f} {when} > {limit:.1f}" for when, value in
                (("before", load.load_before), ("after", load.load_after)) if value is not None and value > limit]
    return out


def describe(load: Load) -> str:
    """One line's worth: `load 1.62->1.80, steal 0.0%, others 0.05 CPUs` (n/a where unknown)."""
    def num(x: float | None, fmt: str, unit: str = "") -> str:
        return "n/a" if x is None else format(x, fmt) + unit
    return (f"load {num(load.load_before, '.2f')}->{num(load.load_after, '.2f')}, "
            f"steal {num(None if load.steal is None else 100 * load.steal, '.1f', '%')}, "
            f"others {num(load.others, '.2f', ' CPUs')}")


def span(loads: list[Load]) -> str:
    """The loads of many runs in one phrase: `load 1.62-3.10, steal <= 0.3%, others <= 0.40 CPUs`."""
    lv = [x for g in loads for x in (g.load_before, g.load_after) if x is not None]
    st = [g.steal for g in loads if g.steal is not None]
    ot = [g.others for g in loads if g.others is not None]
    return (f"load {min(lv):.2f}-{max(lv):.2f}" if lv else "load n/a") + \
        (f", steal <= {100 * max(st):.1f}%" if st else "") + (f", others <= {max(ot):.2f} CPUs" if ot else "")
