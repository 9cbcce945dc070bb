"""`main`'s first screen in MLflow's UI: the experiment's description says who is champion and why
not the others (on its first line, the one the experiment page shows), and each candidate's training
run carries its verdict, certified quality and truth as the columns of the experiment's candidates view
(tracking/experiment_view.py: the candidates as top-level rows)."""
from __future__ import annotations

import pandas as pd

from rlhf_mlflow.tracking import experiment_view as EV
from rlhf_mlflow.tracking import registry as REG


def _num(x, fmt: str = ".3f") -> str | None:
    return None if x is None or pd.isna(x) else format(float(x), fmt)


def verdict(row) -> str:
    """`champion v3`, `refused v2: family_quality, certifiable`, `superseded v1 by v3`, ..."""
    decision = "champion" if row["champion"] else (row["decision"] or "undecided")
    word, _, rest = decision.partition(" ")  # "superseded by v3"
    refused_by = row.get("refused_by") or ""
    return (f"{word} v{row['model_version']}" + (f" {rest}" if rest else "")
            + (f": {refused_by}" if word == "refused" and refused_by else ""))


def certified(row) -> str:
    est, lo, hi = (_num(row.get(k)) for k in ("certified_balanced", "certified_lo", "certified_hi"))
    return "not certifiable" if est is None else f"{est} [{lo}, {hi}]"


def front_page(table: pd.DataFrame, experiment_id: str, main_run_id: str, loosened: list[str]) -> str:
    """The experiment's description. MLflow 3.17's experiment page shows one line of it above the runs
    (the rest behind a fold), so the first line holds the champion, a loosened gate, the link to the
    candidates view and why the others are not champion; then each other candidate in full, and links.
    The first line's link is the one markdown in it: the experiments list shows the description raw."""
    champ = table[table["champion"]] if len(table) else table
    if len(champ):
        c = champ.iloc[0]
        truth = _num(c.get("truth_balanced"))
        head = (f"Champion: v{c['model_version']} {c['candidate']}, certified balanced {certified(c)}"
                + (f", true {truth}" if truth else ""))
    else:
        current = REG.champion_version()
        head = ("No champion from this run" + (f" (the champion is still v{current.version})" if current else "")
                + ": no candidate passed every guardrail")
    if loosened:
        head += f" — under NON-DEFAULT guardrails: {', '.join(loosened)}"
    first = " · ".join([head, f"[every candidate with its verdict]({EV.view_link(experiment_id)})", *why_not(table)])
    others = [_other(r) for _, r in table.iterrows() if not r["champion"]]
    links = (f"[every candidate with its verdict]({EV.view_link(experiment_id)}) · "
             f"[main's summary](#/experiments/{experiment_id}/runs/{main_run_id}) · "
             f"[the registry](#/models/{REG.REGISTERED_MODEL})")
    return "\n".join([first, "", *(["Not the champion:", *others, ""] if others else []), links]) + "\n"


def why_not(table: pd.DataFrame) -> list[str]:
    """The candidates that are not champion, short: `refused: v2, v3 not certifiable; v8 beats_champion`
    (each by the first guardrail it failed: `certifiable` fails every estimate-based one after it) and
    `superseded: v1, v6`."""
    refused: dict[str, list[int]] = {}
    superseded: list[int] = []
    for _, row in table.iterrows():
        word = (row["decision"] or "undecided").split(" ", 1)[0]
        if row["champion"] or word == "promoted":
            continue
        if word == "superseded":
            superseded.append(int(row["model_version"]))
            continue
        first = (row.get("refused_by") or word).split(",")[0].strip()
        refused.setdefault("not certifiable" if first == "certifiable" else first, []).append(int(row["model_version"]))
    out = ["refused: " + "; ".join(", ".join(f"v{v}" for v in sorted(vs)) + f" {why}" for why, vs in refused.items())
           ] if refused else []
    return out + ([f"superseded: {', '.join(f'v{v}' for v in sorted(superseded))}"] if superseded else [])


def _other(row) -> str:
    """`- v3 default-s800: refused by certifiable, family_change`, `- v6 fourfam-s800: superseded by v7`."""
    decision = (row["decision"] or "undecided") + (f" by {row['refused_by']}" if row.get("refused_by") else "")
    return f"- v{row['model_version']} {row['candidate']}: {decision}"


def publish(table: pd.DataFrame, experiment_id: str, main_run_id: str, loosened: list[str]) -> str:
    """Label each candidate's training run, write the candidates view and the front page; returns the
    view's link."""
    for _, row in table.iterrows():
        truth = _num(row.get("truth_balanced"))
        EV.label_candidate(REG.get_version(row["model_version"]).run_id, verdict(row), certified(row),
                           truth or "not graded")
    champion = REG.champion_version()
    if champion is not None:  # an earlier main's champion, replaced since, says so in the view too
        EV.relabel_former_champions(experiment_id, str(champion.version))
    EV.mark_kind(experiment_id)  # `mlflow run --experiment-name` creates the experiment without it
    link = EV.publish_view(experiment_id)
    EV.publish_front_page(experiment_id, front_page(table, experiment_id, main_run_id, loosened))
    return link
