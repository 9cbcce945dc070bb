"""Markdown a person reads in the MLflow UI: the certification table, the release verdict (a model
version's description), the guardrails (the registered model's) and main's story (its run's)."""
from __future__ import annotations

import pandas as pd

from rlhf_mlflow.decisions.guardrails import GuardrailConfig


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


def verdict_markdown(version, results: dict, decision: str, report: dict, loosened: list[str] = (),
                     evidence: str = "recomputed") -> str:
    """The release verdict a model version's description holds: the decision, the certified balanced
    quality with its interval, any threshold that was not the default and evidence release did not
    recompute, then each failing guardrail on a line of its own."""
    b = report["balanced"]
    certified = (f"certified balanced {b['estimate']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}], gain {b['gain']:+.3f} "
                 f"over the reference" if b.get("certifiable") else "balanced quality not certifiable")
    failing = [(k, why) for k, (ok, why) in results.items() if not ok]
    head = f"{decision.upper()} (version {version}): {certified}."  # plain: the registry's list shows it raw
    if loosened:
        head += f" NON-DEFAULT THRESHOLDS: {', '.join(loosened)}."
    if evidence != "recomputed":
        head += f" Evidence {evidence}."
    if not failing:
        return head + (f" Every guardrail passed ({', '.join(results)})" + (" under those thresholds." if loosened
                                                                               else "."))
    return head + "\n\nFailed:\n" + "\n".join(f"- **{k}**: {_short(why)}" for k, why in failing)


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def gate_markdown() -> str:
    """The registered model's description: what `@champion` means and the gate behind it, with the
    default thresholds (a release under other thresholds says so on its version: description and
    `release.non_default` tag)."""
    cfg = GuardrailConfig()
    return ("Policies trained by rlhf_mlflow. `@champion` is moved only by `rlhf-mlflow release`, when every "
            "guardrail passes on a certification the release checked and recomputed itself from its inputs "
            "(evidence whose inputs are missing, changed or not the certify run's own is refused). Each version's "
            "description holds its verdict, and names any threshold that was not the default "
            "(tag `release.non_default`). The guardrails, at their default thresholds:\n\n"
            f"- **certifiable**: every family certified from the expert set (ESS >= {cfg.min_ess:g}, k-hat <= "
            f"{cfg.max_khat:g}) or from >= {cfg.min_labels} expert labels on the policy's own answers, at certify's "
            "default interval level and widenings\n"
            f"- **balanced_gain**: certified balanced quality beats the reference by >= {cfg.min_balanced_gain:g}"
            + (", its interval above zero" if cfg.require_significant_gain else "") + "\n"
            f"- **family_change**: no family's certified change below {cfg.min_family_change:g}\n"
            f"- **family_kl**: KL to the reference <= {cfg.max_family_kl:g} nats in every family\n"
            f"- **marker_collapse**: a flagged shortcut's count rises by <= {cfg.max_marker_increase:g} per answer\n"
            f"- **beats_champion**: certified balanced above the champion's (margin {cfg.champion_margin:g}), both "
            "certified on the same expert set\n")


def story_markdown(table) -> str:
    """`main`'s outcome, narrow enough to read in the MLflow UI without scrolling: the champion in a
    sentence, then a row per candidate, decision first (the full table is summary.csv)."""
    champ = table[table["champion"]] if len(table) else table
    if len(champ):
        c = champ.iloc[0]
        head = (f"**Champion: version {c['model_version']} ({c['candidate']})**,\ncertified balanced "
                f"{_certified(c)}, oracle truth {_n(c['truth_balanced'])}.")
    else:
        head = "**No champion**: no candidate passed every guardrail."
    c = table.attrs.get("ceiling")
    if c:
        head += (f"\nIts truth is {c['fraction']:.0%} of what its recipe reaches on the true reward "
                 f"({c['ceiling_truth_balanced']:.3f}, the ceiling).")
    rows = [{"decision": r["decision"], "candidate": r["candidate"], "v": r["model_version"],
             "certified (90%)": _certified(r), "labels": r["labels"], "refused by": r.get("refused_by") or "",
             "truth": r["truth_balanced"]} for _, r in table.iterrows()]
    return head + "\n\n" + markdown_table(pd.DataFrame(rows, columns=["decision", "candidate", "v", "certified (90%)",
                                                                     "labels", "refused by", "truth"]))


def _certified(row) -> str:
    est, lo, hi = row["certified_balanced"], row["certified_lo"], row["certified_hi"]
    if est is None or est != est:
        return "not certifiable"
    return f"{est:.3f} [{lo:.3f}, {hi:.3f}]"


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
