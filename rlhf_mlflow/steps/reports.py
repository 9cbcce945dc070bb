"""Markdown a person reads in the MLflow UI: the certification table, the release verdict (a model
version's description), the guardrails (the registered model's) and main's story (its run's)."""
from __future__ import annotations

import re

import pandas as pd

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions.guardrails import GuardrailConfig


def _n(x, fmt=".3f") -> str:
    return "—" if x is None else format(x, fmt)


def certification_markdown(report: dict) -> str:
    """One short row per group, the mixes (balanced, pilot) first: the certified number with its 90%
    interval, the gain over the reference, the family's KL, which evidence certified it, and why not
    (every other number is in the run's certification_table.json)."""
    head = "| | certified [90%] | gain [90%] | KL | certified by | status |\n|---|---|---|---|---|---|\n"
    lines = []
    for agg in ("balanced", "pilot"):
        if agg in report:
            r = report[agg]
            lines.append(f"| **{agg}** | {_certified(r)} | {_gain(r)} | | families' mix | {r['reason']} |")
    for f, r in report["families"].items():
        lines.append(f"| {f} | {_certified(r)} | {_gain(r)} | {_n(r['kl'], '.2f')} | {evidence_words(r)} | {r['reason']} |")
    subject = report.get("subject", {})
    title = f"# Certification of {subject.get('registered_model', 'policy')} version {subject.get('model_version', '?')}\n\n"
    about = ("Expert set: doubly-robust off-policy estimate from the labelled reference samples (a seeded "
             "bootstrap interval); ESS = its effective sample size. Expert labels: PPI++ on labels of the "
             "policy's own answers; both: one estimate weighted by their variances. Every number: "
             "certification_table.json.\n\n")
    return (title + about + head + "\n".join(lines) + "\n" + _labels_line(report.get("labels_used"))
            + _chosen_line(report.get("chosen_on")))


def _chosen_line(chosen: dict | None) -> str:
    """That the expert set chose the checkpoint, so it was no evidence of its value (steps/selection.py)."""
    if not chosen:
        return ""
    return (f"\nThe checkpoint was chosen on this expert set's estimates by {chosen['by']} (training run "
            f"{chosen['train_run']}): the expert set is not evidence of its value (the winner's curse); only labels "
            "on its own samples certify it.\n")


def _labels_line(used: dict | None) -> str:
    """Where the expert labels a report used came from (its `labels_used`: every id is there)."""
    if not used:
        return ""
    on = used["bought_on"]
    whose = (f"version {on['model_version']}'s answers" if on.get("model_version") else "the policy's answers")
    whence = (f" (label requests of run {on['label_requests_run']})" if on.get("label_requests_run")
              else f" (rows of {on['samples']}, sha256 {on['samples_sha256'][:12]})" if on.get("samples") else "")
    return (f"\nExpert labels: {used['labels']} from {used['file']} (sha256 {used['sha256'][:12]}), bought on "
            f"{whose}{whence}; every label's id: the report's `labels_used`.\n")


def evidence_words(row: dict) -> str:
    """Which evidence certified a family: the expert set (off-policy, with its ESS), expert labels on the
    policy's own samples (with their number), or both joined (with their weights in the correction,
    decisions/combine.py); "none" when neither could."""
    if row.get("method") == "ppi":
        return f"expert labels on own samples (n={row.get('labels')})"
    if row.get("method") == "ppi+dr":
        w = row.get("evidence_weights", {})
        return (f"expert set (ESS {row['ess']:.0f}, weight {w.get('expert_set', 0):.2f}) + expert labels on own "
                f"samples (n={row.get('labels')}, weight {w.get('policy_labels', 0):.2f})")
    if not row.get("certifiable"):
        return "none"
    return f"expert set (off-policy, ESS {row['ess']:.0f})"


def _certified(r: dict) -> str:
    return "—" if r.get("estimate") is None else f"{r['estimate']:.3f} {_interval(r)}"


def _gain(r: dict) -> str:
    return "—" if r.get("gain") is None else f"{r['gain']:+.3f} {_interval(r, 'gain_', '+.3f')}"


def _interval(r: dict, prefix: str = "", fmt: str = ".3f") -> str:
    lo, hi = r.get(prefix + "lo"), r.get(prefix + "hi")
    return "—" if lo is None else f"[{lo:{fmt}}, {hi:{fmt}}]"


def rounded(value, digits: int = 4):
    """A number as a table shows it (4 decimals; nested lists and dicts too), anything else as it is."""
    if isinstance(value, float):
        return value if value != value or value in (float("inf"), float("-inf")) else round(value, digits)
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    return value


def release_markdown(version: str, results: dict, decision: str, champion: str | None) -> str:
    rows = "\n".join(f"| {name} | {'pass' if ok else '**fail**'} | {why} |" for name, (ok, why) in results.items())
    return (f"# Release of rlhf-policy version {version}: {decision}\n\n"
            f"Champion before: {champion or 'none'}\n\n| guardrail | result | reason |\n|---|---|---|\n{rows}\n")


FIRST_LINE = 100
"""How long a version description's first line may grow: the registry's list shows only that line."""


def verdict_markdown(version, results: dict, decision: str, report: dict, loosened: list[str] = (),
                     evidence: str = "recomputed", links: list[str] = ()) -> str:
    """A model version's description. The first line stands alone (the registry's list shows only
    it): the decision, the failing guardrails in brief (or the certified balanced quality), any
    non-default threshold and evidence release did not recompute. Then the certified balanced quality,
    each failing guardrail in full on a line of its own, the ones that passed, and `links` (markdown)."""
    failing = [(k, why) for k, (ok, why) in results.items() if not ok]
    flags = (f" NON-DEFAULT THRESHOLDS: {', '.join(loosened)}." if loosened else "") \
        + (f" Evidence {evidence.split(':')[0]}." if evidence != "recomputed" else "")
    b = report["balanced"]
    head = f"{decision.upper()} v{version}: "  # plain: the registry's list shows it raw
    room = max(FIRST_LINE - len(head) - len(flags), 60)
    if failing:
        summary = _failing_summary(failing, report, room)
    else:
        summary = _cut(f"certified balanced {b['estimate']:.3f} {_interval(b)}, gain {b['gain']:+.3f}"
                       if b.get("certifiable") else "every guardrail passed", room)
    lines = [head + summary + flags, ""]
    lines.append(f"Certified balanced {b['estimate']:.3f} {_interval(b)}, gain {b['gain']:+.3f} "
                 f"{_interval(b, 'gain_', '+.3f')} over the reference {b['reference']:.3f}." if b.get("certifiable")
                 else f"Balanced quality not certifiable ({b['reason']}).")
    if evidence != "recomputed":
        lines += ["", f"Evidence: {evidence}."]
    if failing:
        lines += ["", "Failed:"] + [f"- **{k}**: {why}" for k, why in failing]
    passed = [k for k, (ok, _) in results.items() if ok]
    lines += ["", (f"Passed: {', '.join(passed)}" if failing else f"Every guardrail passed: {', '.join(passed)}")
              + (" (under the non-default thresholds above)." if loosened else ".")]
    return "\n".join(lines + (["", " · ".join(links)] if links else [])) + "\n"


def superseded_markdown(version, champion, previous: str | None, direct: bool) -> str:
    """A promoted version's description once the alias has moved on: SUPERSEDED (by the version that
    replaced it, or naming today's champion when that is not known), then the verdict it was promoted on."""
    by = f"by v{champion}" if direct else f"(champion now v{champion})"
    return (f"SUPERSEDED v{version} {by}: no longer the champion; the verdict it was promoted on follows.\n\n"
            f"Was: {previous or '(no verdict recorded)'}")


def _failing_summary(failing: list, report: dict, room: int) -> str:
    """Every failing guardrail by name, each with its reason in brief while they fit in `room`
    characters; past that the first keeps what fits of its reason ("…") and the others their names."""
    full = ", ".join(f"{k} ({_brief(k, why, report)})" for k, why in failing)
    if len(full) <= room:
        return full
    (name, why), rest = failing[0], ", ".join(k for k, _ in failing[1:])
    left = room - len(name) - 3 - (len(rest) + 2 if rest else 0)
    first = f"{name} ({_cut(_brief(name, why, report), left)})" if left >= 16 else name
    return first + (", " + rest if rest else "")


def _brief(name: str, why: str, report: dict) -> str:
    """A failing guardrail's reason in a few words, for the description's first line."""
    weak = [(f, r["reason"]) for f, r in report["families"].items() if not r["certifiable"]]
    if name == "certifiable" and weak:
        return ", ".join(f"{f}: {re.sub(r' of [0-9].*', '', why_f.split(';')[0])}" for f, why_f in weak)
    if name == "certifiable" or name == "balanced_gain" and "not certifiable" in why:
        return why.split(":")[0] if name == "certifiable" else "not certifiable"
    if why.startswith("cannot compare"):
        return "cannot compare: " + ("another expert set" if "expert set" in why else "no balanced estimate")
    for long, short in (("worse than the reference: ", ""), ("change unknown: ", "unknown: "),
                        ("collapse onto flagged shortcuts: ", ""), ("balanced gain ", "gain "),
                        ("certified balanced ", "")):
        why = why.replace(long, short)
    return why


TAG_CHARS = 30
"""What MLflow's UI shows whole of a tag in a list (key and value together)."""


def failed_tags(results: dict, report: dict, prefix: str = "failed.") -> dict[str, str]:
    """Each failing guardrail's brief reason, short enough that its tag shows whole in the registry's
    list: the brief reason when it fits, else the families it failed on (`ember` rather than `ember: ESS
    6.9 < 10`)."""
    out = {}
    for name, (ok, why) in results.items():
        if ok:
            continue
        room = TAG_CHARS - len(prefix) - len(name)
        brief = _brief(name, why, report)
        families = [f for f in V.FAMILIES if re.search(rf"\b{f}\b", why)]
        if len(brief) <= room:
            pass
        elif why.startswith("unknown: ") or (name != "certifiable" and ("not certifiable" in why
                                                                          or why.startswith("cannot compare"))):
            brief = "unknown"
        elif name == "beats_champion":
            brief = "lower"
        elif families:  # the families it failed on
            brief = ", ".join(families)
        out[name] = _cut(brief, room)
    return out


def _cut(text: str, limit: int) -> str:
    """`text`, or its words up to `limit` characters and "…" (the full text follows on later lines)."""
    return text if len(text) <= limit else text[:limit - 1].rsplit(" ", 1)[0].rstrip(",;") + "…"


def gate_markdown(champion=None, recipe: str | None = None) -> str:
    """The registered model's description: the champion on its first line (the version and its recipe,
    or that there is none), then what `@champion` means and the gate behind it, with the default
    thresholds (a release under other thresholds says so on its version's description)."""
    cfg = GuardrailConfig()
    first = (f"Champion: v{champion} ({recipe}), `models:/rlhf-policy@champion`. Each version's description "
             "says why it is or is not the champion." if champion is not None else
             "No champion yet: no version has passed every guardrail.")
    return (first + "\n\nPolicies trained by rlhf_mlflow. `@champion` is moved only by `rlhf-mlflow release`, when every "
            "guardrail passes on a certification the release checked and recomputed itself from its inputs "
            "(evidence whose inputs are missing, changed or not the certify run's own is refused). Each version's "
            "description holds its verdict, and names any threshold that was not the default. The guardrails, at their default thresholds:\n\n"
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
                f"{_story_certified(c)}, oracle truth {_n(c['truth_balanced'])}.")
    else:
        head = "**No champion**: no candidate passed every guardrail."
    c = table.attrs.get("ceiling")
    if c:
        head += (f"\nIts truth is {c['fraction']:.0%} of what its recipe reaches on the true reward "
                 f"({c['ceiling_truth_balanced']:.3f}, the ceiling).")
    rows = [{"decision": r["decision"], "candidate": r["candidate"], "v": r["model_version"],
             "certified (90%)": _story_certified(r), "labels": r["labels"], "refused by": r.get("refused_by") or "",
             "truth": r["truth_balanced"]} for _, r in table.iterrows()]
    return head + "\n\n" + markdown_table(pd.DataFrame(rows, columns=["decision", "candidate", "v", "certified (90%)",
                                                                     "labels", "refused by", "truth"]))


def rounds_markdown(records: list[dict], table=None) -> str:
    """The rounds as a markdown table, round 1 (the world's reward model) first, each with its champion's
    certified quality and truth from `table` (main's summary; '—' where it lacks them); '' when main ran
    one round."""
    if not records:
        return ""
    by_version = ({str(v): r for v, (_, r) in zip(table["model_version"], table.iterrows())}
                  if table is not None and len(table) else {})  # the column, not the row: iterrows casts ints

    def row(round_, model, agreement, champion, repair_labels, spent) -> dict:
        found = by_version.get(str(champion))
        return {"round": round_, "reward model": model, "expert agreement (r, cross-validated)": agreement,
                "champion": f"v{champion}" if champion else None,
                "certified (90%)": _story_certified(found) if found is not None else None,
                "truth": found["truth_balanced"] if found is not None else None,
                "repair labels": repair_labels, "labels spent so far": spent}
    first = records[0]
    rows = [row(1, "the world's", None, first.get("champion_before"), 0, first.get("labels_before"))]
    rows += [row(r["round"], f"v{r['rm_version']} ({'production' if r['rm_promoted'] else 'refused'})",
                 r["rm_agreement"], r.get("champion"), r["repair_labels"], r.get("labels_spent")) for r in records]
    return "\n\n### Rounds\n\n" + markdown_table(pd.DataFrame(rows, dtype=object))  # object: ints stay ints


def _story_certified(row) -> str:
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
