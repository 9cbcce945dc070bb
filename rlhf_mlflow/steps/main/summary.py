"""`main`'s summary table, built with pandas from the runs and registry versions a `main` run made:
per candidate its dev proxy, certified balanced quality and interval, the expert labels its certify run
used, every guardrail (its release run's release.json), the release decision and the oracle's truth."""
from __future__ import annotations

import pandas as pd

from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.training.recipes import CANDIDATES


def summary_table(parent_run_ids: str | list[str]) -> pd.DataFrame:
    """Per registered candidate made under `parent_run_ids` (a main run, or a main and the runs it
    resumed): dev proxy, certified balanced quality with its interval, every guardrail, the release
    decision and the oracle's truth."""
    ids = [parent_run_ids] if isinstance(parent_run_ids, str) else parent_run_ids
    frames = [T.search_runs(f"tags.mlflow.parentRunId = '{i}'") for i in ids]
    for frame in list(frames):  # a later round's steps are children of its round run
        if len(frame) and "tags.rlhf.step" in frame:
            frames += [T.search_runs(f"tags.mlflow.parentRunId = '{round_id}'")
                       for round_id in frame.loc[frame["tags.rlhf.step"] == "round", "run_id"]]
    frames = [f for f in frames if len(f)]
    # newest first (a step a resume ran again is read from its last run)
    runs = pd.concat(frames, ignore_index=True).sort_values("start_time", ascending=False) if frames else pd.DataFrame()
    by_step = {step: frame for step, frame in runs.groupby("tags.rlhf.step")} if len(runs) else {}
    train_ids = set(by_step.get("train_rl", pd.DataFrame(columns=["run_id"]))["run_id"])
    versions = [v for v in REG.client().search_model_versions(f"name = '{REG.REGISTERED_MODEL}'")
                if v.run_id in train_ids]
    champion = REG.champion_version()

    def latest(step: str, version: str, key: str):
        frame = by_step.get(step)
        if frame is None or key not in frame:
            return None
        col = "params.model_version" if step != "dev_eval" else "params.policy"
        want = str(version) if step != "dev_eval" else REG.version_uri(version)
        rows = frame[frame[col] == want] if col in frame else frame.iloc[0:0]
        return None if rows.empty or pd.isna(rows.iloc[0][key]) else rows.iloc[0][key]

    rows = []
    order = list(CANDIDATES)  # the order main releases them in
    for v in sorted(versions, key=lambda v: (order.index(v.tags.get("recipe")) if v.tags.get("recipe") in order
                                             else len(order), int(v.version))):
        row = {"candidate": v.tags.get("recipe"), "model_version": str(v.version),
               "step": int(v.tags["checkpoint_step"]) if v.tags.get("checkpoint_step") else None,
               "dev_proxy": latest("dev_eval", v.version, f"metrics.{MN.DEV}proxy_mean"),
               "certified_balanced": latest("certify", v.version, f"metrics.{MN.CERTIFY}certified/balanced"),
               "certified_lo": latest("certify", v.version, f"metrics.{MN.CERTIFY}certified_lo/balanced"),
               "certified_hi": latest("certify", v.version, f"metrics.{MN.CERTIFY}certified_hi/balanced")}
        mv = REG.get_version(v.version)
        row["labels"] = int(latest("certify", v.version, f"metrics.{MN.CERTIFY}policy_labels/total") or 0)
        guardrails = REG.release_record(mv).get("guardrails", {})  # its release run's release.json
        row.update({k: ("pass" if g["pass"] else "fail") for k, g in guardrails.items()})
        row["refused_by"] = ", ".join(k for k, g in guardrails.items() if not g["pass"])
        row["decision"] = mv.tags.get("release.decision")
        row["champion"] = champion is not None and str(champion.version) == str(v.version)
        row["truth_balanced"] = latest("grade", v.version, "metrics.truth/balanced")
        rows.append(row)
    return pd.DataFrame(rows)

