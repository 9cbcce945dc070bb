"""Whole-process A/B: two commands timed in turn, paired per repeat, as a user runs them.

    python benchmarks/ab.py [--repeats 5] [--warmup 1] [--threads 2] [--max-ratio R] -- "COMMAND A" -- "COMMAND B"

A and B are shell command lines (one argument each; several words after a `--` are quoted and joined).
After --warmup uncounted runs of each, every repeat runs both, the order alternating (A B, B A, ...),
and takes the ratio B/A of wall and CPU seconds within the repeat. Per run: wall, user+sys CPU seconds
and peak memory (the operating system's accounting of the finished process tree, os.wait4) and the
machine around it (1-min load before->after, CPU steal, CPUs other processes used:
benchmarks/machine_load.py, whose rule says when a run was busy; --threads is what the commands
themselves run on, which the load average counts). Then each figure's min, median and max per
command, the ratios' median and range, a WARNING naming the busy repeats, and last `verdict:` —
`met` / `not met` (median wall B/A <= --max-ratio), without --max-ratio whether B/A was below or
above 1 in every repeat, `none: machine busy (repeats ...)` or `none: failed runs (...)` when a
command exited non-zero. The commands' output is thrown away: redirect it inside the command to keep it.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import machine_load, paired  # noqa: E402


@dataclass(frozen=True)
class Run:
    """One finished run of a command."""
    wall: float
    cpu: float
    peak_mib: float
    code: int
    load: machine_load.Load


def run_once(command: str) -> Run:
    """Run `command` through the shell, its output discarded, and account for it."""
    before = machine_load.mark()
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    after = machine_load.mark()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    cpu = usage.ru_utime + usage.ru_stime
    return Run(after.wall - before.wall, cpu, usage.ru_maxrss / 1024, proc.returncode,
               machine_load.between(before, after, cpu))


def split_commands(argv: list[str]) -> tuple[list[str], list[str]]:
    """Options before the first `--`, then one command per `--` group (several words: shell-quoted)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    groups: list[list[str]] = [[]]
    for word in argv[i + 1:]:
        if word == "--":
            groups.append([])
        else:
            groups[-1].append(word)
    return argv[:i], [g[0] if len(g) == 1 else shlex.join(g) for g in groups]


def line(r: Run) -> str:
    return (f"{r.wall:8.2f} s wall {r.cpu:8.2f} s cpu {r.peak_mib:7.0f} MiB"
            + (f" exit {r.code}" if r.code else "") + f"  | {machine_load.describe(r.load)}")


def compare(commands: dict[str, str], repeats: int, warmup: int, threads: int) -> dict[str, list[Run]]:
    """Warm-ups, then `repeats` paired repeats in alternating order; prints a line per run and per repeat."""
    for w in range(warmup):
        for name in paired.order(list(commands), w):
            print(f"  warm-up {w + 1} {name}:{line(run_once(commands[name]))}", flush=True)
    runs: dict[str, list[Run]] = {name: [] for name in commands}
    for r in range(repeats):
        for name in paired.order(list(commands), r):
            runs[name].append(run_once(commands[name]))
            why = machine_load.busy_reasons(runs[name][-1].load, threads)
            print(f"  repeat {r + 1} {name}:{line(runs[name][-1])}{'  BUSY: ' + ', '.join(why) if why else ''}",
                  flush=True)
        print(f"  repeat {r + 1} B/A: wall {runs['B'][r].wall / runs['A'][r].wall:.3f}, "
              f"cpu {runs['B'][r].cpu / max(runs['A'][r].cpu, 1e-9):.3f}", flush=True)
    return runs


def report(runs: dict[str, list[Run]], threads: int, max_ratio: float | None) -> None:
    """Min / median / max per figure and command, the paired ratios, the busy warning and the verdict."""
    for figure in ("wall", "cpu", "peak_mib"):
        for name, rs in runs.items():
            v = [getattr(r, figure) for r in rs]
            print(f"{figure:8s} {name}: min {min(v):.2f}, median {statistics.median(v):.2f}, max {max(v):.2f}")
    ratio = {f: paired.summarise(paired.ratios({k: [getattr(r, f) for r in rs] for k, rs in runs.items()}, "B", "A"))
             for f in ("wall", "cpu")}
    print(f"cpu B/A: {ratio['cpu']}")
    print(f"wall B/A: {ratio['wall']}; {machine_load.span([r.load for rs in runs.values() for r in rs])}")
    reasons = [[f"{k}: {w}" for k in runs for w in machine_load.busy_reasons(runs[k][i].load, threads)]
               for i in range(len(runs["A"]))]
    busy = paired.busy_repeats(reasons)
    if busy:
        print(f"WARNING: machine busy in repeats {', '.join(map(str, busy))} (BUSY on their lines; the rule: "
              f"benchmarks/machine_load.py); their ratios measure the load as much as the commands")
    failed = [i + 1 for i in range(len(runs["A"])) if any(runs[k][i].code for k in runs)]
    print(f"verdict: {paired.verdict(ratio['wall'], busy, max_ratio, higher_is_better=False, failed=failed)}")


def main(argv: list[str] | None = None) -> None:
    options, commands = split_commands(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="counted pairs (1 to 100)")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted runs of each command first (0 to 10)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                    help="CPUs the commands themselves keep busy (the busy rule's allowance for the load average)")
    ap.add_argument("--max-ratio", type=float, default=None, help="the verdict's bar: median wall B/A at most this")
    a = ap.parse_args(options)
    if len(commands) != 2 or not all(commands):
        ap.error('give exactly two commands: -- "COMMAND A" -- "COMMAND B"')
    if not 1 <= a.repeats <= 100 or not 0 <= a.warmup <= 10 or a.threads < 1:
        ap.error("--repeats must be 1 to 100, --warmup 0 to 10, --threads at least 1")
    named = dict(zip("AB", commands))
    print(f"A: {named['A']}\nB: {named['B']}\n{a.repeats} paired repeats after {a.warmup} warm-up(s), "
          f"order alternating; {os.cpu_count()} CPUs")
    report(compare(named, a.repeats, a.warmup, a.threads), a.threads, a.max_ratio)


if __name__ == "__main__":
    main()
