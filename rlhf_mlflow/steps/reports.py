"""Markdown reports a person reads in the MLflow UI: the certification table and the release verdict."""
from __future__ import annotations


def _n(x, fmt=".3f") -> str:
    return "—" if x is None else format(x, fmt)


def certification_markdown(report: dict) -> str:
    head = ("| family | certified | 90% interval | reference | gain | gain interval | ESS | pop. ESS | k-hat | max w | "
            "KL | status |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for f, r in report["families"].items():
        lines.append(f"| {f} | {_n(r['estimate'])} | {_interval(r)} | {r['reference']:.3f} | {_n(r['gain'], '+.3f')} | "
                     f"{_interval(r, 'gain_')} | {r['ess']:.1f} | {r['pop_ess']:.1f} | {r['khat']:.2f} | "
                     f"{r['max_weight_share']:.2f} | {r['kl']:.2f} | {r['reason']} |")
    for agg in ("balanced", "pilot"):
        if agg in report:
            r = report[agg]
            lines.append(f"| **{agg}** | {_n(r['estimate'])} | {_interval(r)} | {r['reference']:.3f} | "
                         f"{_n(r['gain'], '+.3f')} | {_interval(r, 'gain_')} | | | | | | {r['reason']} |")
    subject = report.get("subject", {})
    title = f"# Certification of {subject.get('registered_model', 'policy')} version {subject.get('model_version', '?')}\n\n"
    method = report["families"][next(iter(report["families"]))]["method"] if report["families"] else "?"
    about = (f"Estimator: {method}; intervals: seeded bootstrap over the expert rows; "
             "pop. ESS = n / E_pi[w] from the policy's own samples.\n\n")
    return title + about + head + "\n".join(lines) + "\n"


def _interval(r: dict, prefix: str = "") -> str:
    lo, hi = r.get(prefix + "lo"), r.get(prefix + "hi")
    return "—" if lo is None else f"[{lo:.3f}, {hi:.3f}]"


def release_markdown(version: str, results: dict, decision: str, champion: str | None) -> str:
    rows = "\n".join(f"| {name} | {'pass' if ok else '**fail**'} | {why} |" for name, (ok, why) in results.items())
    return (f"# Release of rlhf-policy version {version}: {decision}\n\n"
            f"Champion before: {champion or 'none'}\n\n| guardrail | result | reason |\n|---|---|---|\n{rows}\n")


def markdown_table(frame) -> str:
    """A pandas frame as a GitHub markdown table (no extra dependency)."""
    def cell(v) -> str:
        if v is None or (isinstance(v, float) and v != v):
            return "—"
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"
