"""Paired repeats: the order arms run in within each repeat, the per-repeat ratio of an arm to the
base arm, their median and range, and the verdict (none when the machine was busy). Pure functions,
shared by benchmarks/train_rl_speed.py and benchmarks/ab.py.

Why paired: on a shared VM the machine's speed drifts by tens of percent between minutes, so a ratio of
two medians taken at different times measures the drift. Each repeat runs every arm once, back to back,
in an order that rotates between repeats (no arm always first or last), and the ratio is taken within
the repeat; the median of those ratios is the figure to quote, their range how far to trust it.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def order(arms: Sequence[T], repeat: int) -> list[T]:
    """The arms in the order repeat `repeat` (0-based) runs them: rotated by one each repeat
    (A B C, B C A, C A B, ...; two arms alternate A B, B A)."""
    k = repeat % len(arms) if arms else 0
    return list(arms[k:]) + list(arms[:k])


def ratios(values: dict[str, list[float]], arm: str, base: str) -> list[float]:
    """values[arm][r] / values[base][r] for every repeat r both have."""
    return [a / b for a, b in zip(values[arm], values[base])]


@dataclass(frozen=True)
class Summary:
    """Per-repeat ratios and what to quote of them."""
    ratios: list[float]
    median: float
    lo: float
    hi: float

    def __str__(self) -> str:
        return (f"median {self.median:.2f}, range {self.lo:.2f}-{self.hi:.2f} "
                f"(repeats {', '.join(f'{r:.2f}' for r in self.ratios)})")


def summarise(rs: Sequence[float]) -> Summary:
    """Median and min-max of per-repeat ratios (at least one)."""
    if not rs:
        raise ValueError("no repeats to summarise: --repeats must be at least 1")
    return Summary(list(rs), statistics.median(rs), min(rs), max(rs))


def busy_repeats(reasons: Sequence[Sequence[str]]) -> list[int]:
    """1-based numbers of the repeats with any busy reason (reasons[r]: those of repeat r's runs)."""
    return [r + 1 for r, rs in enumerate(reasons) if rs]


def verdict(summary: Summary, busy: Sequence[int], target: float | None, higher_is_better: bool = True,
            failed: Sequence[int] = ()) -> str:
    """`met` / `not met` (the median against `target`), `none: machine busy (repeats ...)` when any
    repeat was busy, `none: failed runs (repeats ...)` when any run failed. Without a target, which
    side the pairs favour: `above 1 in every repeat`, `below 1 in every repeat` or `none: the repeats
    disagree`."""
    if failed:
        return f"none: failed runs (repeats {', '.join(map(str, failed))})"
    if busy:
        return f"none: machine busy (repeats {', '.join(map(str, busy))})"
    if target is not None:
        ok = summary.median >= target if higher_is_better else summary.median <= target
        sign = {(True, True): ">=", (True, False): "<", (False, True): "<=", (False, False): ">"}[higher_is_better, ok]
        return f"{'met' if ok else 'not met'} (median {summary.median:.2f} {sign} {target:g})"
    if summary.lo > 1:
        return "above 1 in every repeat"
    if summary.hi < 1:
        return "below 1 in every repeat"
    return "none: the repeats disagree (range spans 1)"
