"""Release guardrails: pure checks of a certification report (and the current champion's) against
thresholds. Every guardrail returns pass/fail with a one-line reason; release promotes only when
all pass. No guardrail reads an oracle or a world's secret.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core.config import check_range
from rlhf_mlflow.core.errors import InputError


@dataclass(frozen=True)
class GuardrailConfig:
    min_balanced_gain: float = 0.03
    """Certified balanced (deployment-mix) quality must beat the reference by at least this."""
    require_significant_gain: bool = True
    """Also require the lower end of the balanced gain's interval to be above zero."""
    min_family_change: float = -0.03
    """Every family's certified change against the reference must be at least this."""
    min_ess: float = 10.0
    """Every family must be certifiable, by a certification that refused families with fewer effective
    expert samples than this (its own `min_ess`, which certify applied: one threshold, one place)."""
    max_family_kl: float = 4.0
    """Every family's KL(policy || reference) per response, in nats, must be at most this: a cap on drift.
    Runs that collapse a family onto a marker sit at 6-12 nats there; the corrected kl 0.05 recipe at
    1.8-3.3 (certified then from labels on its own responses, where the expert set cannot reach)."""
    max_marker_increase: float = 0.5
    """A flagged shortcut's mean count per response may exceed the reference's by at most this."""
    champion_margin: float = 0.0
    """Certified balanced quality must exceed the current champion's by more than this."""

    def __post_init__(self):
        # every threshold finite and in range: a NaN compares False both ways and would disable its guardrail
        check_range("min_balanced_gain", self.min_balanced_gain, -1, 1)
        check_range("min_family_change", self.min_family_change, -1, 1)
        check_range("champion_margin", self.champion_margin, 0, 1)
        check_range("min_ess", self.min_ess, 1)
        check_range("max_family_kl", self.max_family_kl, 0, lo_open=True)
        check_range("max_marker_increase", self.max_marker_increase, 0)
        if not isinstance(self.require_significant_gain, bool):
            raise InputError(f"require_significant_gain must be true or false, got {self.require_significant_gain!r}")

    @classmethod
    def from_dict(cls, d: dict, where: str = "guardrails") -> "GuardrailConfig":
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise InputError(f"{where}: unknown guardrail key {unknown[0]!r}; valid keys are {names}")
        types = {f.name: type(getattr(cls(), f.name)) for f in fields(cls)}
        out = {}
        for k, v in d.items():
            if types[k] is bool:
                if isinstance(v, str):
                    v = {"true": True, "false": False}.get(v.lower(), v)
            elif isinstance(v, str):
                try:
                    v = float(v)
                except ValueError:
                    raise InputError(f"{where}: {k} must be a number, got {v!r}") from None
            out[k] = v
        return cls(**out)

    def to_dict(self) -> dict:
        return asdict(self)


NAMES = ("certifiable", "balanced_gain", "family_change", "family_kl", "marker_collapse", "beats_champion")


def _certifiable(report: dict, cfg: GuardrailConfig) -> tuple[bool, str]:
    """Every family certifiable, by certify's own refusal rule, applied with a min_ess at least ours."""
    fams = report["families"]
    used = report.get("config", {}).get("min_ess", cfg.min_ess)
    if used < cfg.min_ess:
        return False, (f"certified with min_ess {used:g}, below the {cfg.min_ess:g} required: certify again with "
                       f"--min-ess {cfg.min_ess:g} (or release with --guardrail min_ess={used:g})")
    weak = [f"{f} ({r['reason']})" for f, r in fams.items() if not r["certifiable"]]
    if weak:
        return False, "not certifiable: " + ", ".join(weak)
    return True, f"every family certifiable (min_ess {used:g}), min ESS {min(r['ess'] for r in fams.values()):.1f}"


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


def evaluate(report: dict, cfg: GuardrailConfig = GuardrailConfig(),
             champion: dict | None = None) -> dict[str, tuple[bool, str]]:
    """Each guardrail's (passed, reason) for a certification `report` (rlhf_mlflow.certify format).
    `champion` is the current champion's report (or None when there is none yet)."""
    fams = report["families"]
    bal = report["balanced"]
    out = {}

    out["certifiable"] = _certifiable(report, cfg)

    if not bal["certifiable"]:
        out["balanced_gain"] = (False, f"balanced quality not certifiable ({bal['reason']})")
    else:
        ok = bal["gain"] >= cfg.min_balanced_gain
        ok_sig = not cfg.require_significant_gain or bal["gain_lo"] > 0
        why = (f"balanced gain {_fmt(bal['gain'])} [{_fmt(bal['gain_lo'])}, {_fmt(bal['gain_hi'])}] "
               f"vs required {cfg.min_balanced_gain:+.3f}"
               + ("" if ok_sig else "; interval includes zero"))
        out["balanced_gain"] = (ok and ok_sig, why)

    worse = [f"{f} {_fmt(r['gain'])}" for f, r in fams.items()
             if r["gain"] is not None and r["gain"] < cfg.min_family_change]
    unknown = [f for f, r in fams.items() if r["gain"] is None]
    if worse or unknown:
        out["family_change"] = (False, "; ".join(
            ([f"worse than the reference: {', '.join(worse)}"] if worse else [])
            + ([f"change unknown: {', '.join(unknown)}"] if unknown else [])))
    else:
        lowest = min(fams, key=lambda f: fams[f]["gain"])
        out["family_change"] = (True, f"lowest family change {lowest} {_fmt(fams[lowest]['gain'])}")

    far = [f"{f} {r['kl']:.2f}" for f, r in fams.items() if r["kl"] > cfg.max_family_kl]
    top = max(fams, key=lambda f: fams[f]["kl"])
    out["family_kl"] = (not far, f"KL above {cfg.max_family_kl:g}: {', '.join(far)}" if far
                        else f"max family KL {top} {fams[top]['kl']:.2f} <= {cfg.max_family_kl:g}")

    collapsed, checked = [], 0
    for f, r in fams.items():
        for s in r.get("shortcuts", []):
            checked += 1
            rise = s["policy_count"] - s["reference_count"]
            if rise > cfg.max_marker_increase:
                collapsed.append(f"{f} {SR.describe(s)} {s['reference_count']:.2f}->{s['policy_count']:.2f}")
    out["marker_collapse"] = (not collapsed, "collapse onto flagged shortcuts: " + ", ".join(collapsed)
                              if collapsed else f"{checked} flagged shortcut(s) within "
                              f"+{cfg.max_marker_increase:g} of the reference")

    if champion is None:
        out["beats_champion"] = (True, "no current champion")
    elif not bal["certifiable"] or not champion["balanced"]["certifiable"]:
        out["beats_champion"] = (False, "cannot compare with the champion: a balanced estimate is missing")
    else:
        c = champion["balanced"]["estimate"]
        ok = bal["estimate"] > c + cfg.champion_margin
        out["beats_champion"] = (ok, f"certified balanced {bal['estimate']:.3f} vs champion {c:.3f}")
    return out
