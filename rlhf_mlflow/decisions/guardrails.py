"""Release guardrails: pure checks of a certification report (and the current champion's) against
thresholds. Every guardrail returns pass/fail with a one-line reason; release promotes only when
all pass. No guardrail reads an oracle or a world's secret.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.config import check_range
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.decisions.certify import CertifyConfig


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
    max_khat: float = 0.7
    """... and families whose importance weights' Pareto tail k-hat was above this (certify's `max_khat`)."""
    min_labels: int = 20
    """... and certified a family from expert labels only with at least this many (certify's `min_labels`)."""
    max_family_kl: float = 6.0
    """Every family's KL(policy || reference) per response, in nats, must be at most this: a cap on drift.
    Runs that collapse a family onto a marker sit at 6-12 nats there. On the default world the corrected
    kl 0.05 recipe reaches 1.8-3.3 on the world's reward model, 4.0-4.8 on a repaired one (truth 0.72), and
    5.1-5.4 on the true reward itself (the ceiling): a cap of 4 refused policies that were better for the
    distance, certified from labels on their own responses where the expert set cannot reach."""
    max_marker_increase: float = 0.5
    """A flagged shortcut's mean count per response may exceed the reference's by at most this."""
    champion_margin: float = 0.0
    """Certified balanced quality must exceed the current champion's by more than this."""
    waive: str = ""
    """Guardrails (of WAIVABLE, joined by '+') that pass when their evidence is missing instead of
    failing as unknown, e.g. `marker_collapse` for a certification made without a diagnostic. A waiver
    never passes evidence that fails; like any other non-default threshold it is written on the version."""

    def __post_init__(self):
        # every threshold finite and in range: a NaN compares False both ways and would disable its guardrail
        check_range("min_balanced_gain", self.min_balanced_gain, -1, 1)
        check_range("min_family_change", self.min_family_change, -1, 1)
        check_range("champion_margin", self.champion_margin, 0, 1)
        check_range("min_ess", self.min_ess, 1)
        check_range("max_khat", self.max_khat, 0)
        check_range("min_labels", self.min_labels, 2, integer=True)
        check_range("max_family_kl", self.max_family_kl, 0, lo_open=True)
        check_range("max_marker_increase", self.max_marker_increase, 0)
        unknown = sorted(set(self.waived()) - set(WAIVABLE))
        if unknown:
            raise InputError(f"waive: {unknown[0]!r} cannot be waived; waivable guardrails (joined by '+'): "
                             f"{', '.join(WAIVABLE)}")
        if not isinstance(self.require_significant_gain, bool):
            raise InputError(f"require_significant_gain must be true or false, got {self.require_significant_gain!r}")

    def waived(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in str(self.waive).split("+") if n.strip())

    @classmethod
    def from_dict(cls, d: dict, where: str = "guardrails") -> "GuardrailConfig":
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise InputError(f"{where}: unknown guardrail key {unknown[0]!r}; valid keys are {names}")
        types = {f.name: type(getattr(cls(), f.name)) for f in fields(cls)}
        out = {}
        for k, v in d.items():
            if types[k] is str:
                v = str(v)
            elif types[k] is bool:
                if isinstance(v, str):
                    v = {"true": True, "false": False}.get(v.lower(), v)
            elif isinstance(v, str):
                try:
                    v = float(v)
                except ValueError:
                    raise InputError(f"{where}: {k} must be a number, got {v!r}") from None
            if types[k] is int and isinstance(v, float) and v.is_integer():
                v = int(v)
            out[k] = v
        return cls(**out)

    def to_dict(self) -> dict:
        return asdict(self)


NAMES = ("certifiable", "balanced_gain", "family_change", "family_kl", "marker_collapse", "beats_champion")
WAIVABLE = ("family_kl", "marker_collapse")
"""The guardrails whose evidence a certification may lack while its estimates stand: KL needs the policy's
log-probs, marker collapse a diagnostic's flagged shortcuts. Missing, each is `unknown` and fails unless
waived (GuardrailConfig.waive)."""
UNKNOWN = "unknown: "


CERTIFY_THRESHOLDS = ("min_ess", "max_khat", "min_labels", "level", "ess_widening", "label_widening",
                      "family_correlation")
"""The numbers of a certification's config that decide what it certifies and how wide its intervals are
(seed, sample counts and label_looks are not thresholds)."""
LEGACY = {"ess_widening": 0.0, "label_widening": 1.0, "family_correlation": 0.0}
"""What a report written before a constant existed was certified with (release._certify_config)."""


def required_thresholds(cfg: GuardrailConfig) -> dict[str, float]:
    """What release requires of a certification's config: min_ess, max_khat and min_labels as the
    guardrails say; the interval level and widenings at least certify's own defaults (they are the
    estimator, not a policy choice)."""
    default = CertifyConfig()
    return {"min_ess": cfg.min_ess, "max_khat": cfg.max_khat, "min_labels": cfg.min_labels,
            **{k: getattr(default, k) for k in CERTIFY_THRESHOLDS[3:]}}


def looser_thresholds(certified_with: dict, cfg: GuardrailConfig) -> list[str]:
    """Each threshold a certification ran with that is looser than release requires, in words; a
    threshold the report does not state counts as looser (it cannot be shown to hold)."""
    out = []
    for key, need in required_thresholds(cfg).items():
        used = certified_with.get(key, LEGACY.get(key))
        upper = key == "max_khat"  # the one threshold where a larger value certifies more
        if not isinstance(used, (int, float)) or (used > need if upper else used < need):
            shown = "unstated" if used is None else f"{used:g}"
            out.append(f"{key} {shown}, {'above' if upper else 'below'} the {need:g} required")
    return out


def non_default(cfg: GuardrailConfig, certified_with: dict | None = None) -> list[str]:
    """Every guardrail threshold, and every certify threshold of the certification, that is not its
    default, as `name=value` (certify's as `certify.name=value`): what a version records it was
    released under."""
    def shown(v):
        return str(v).lower() if isinstance(v, bool) else v if isinstance(v, str) else f"{v:g}"
    out = [f"{k}={shown(v)}" for k, v in asdict(cfg).items() if v != getattr(GuardrailConfig(), k)]
    default = CertifyConfig()
    for key in CERTIFY_THRESHOLDS if certified_with is not None else ():
        used = certified_with.get(key, LEGACY.get(key))
        if used is not None and used != getattr(default, key):
            out.append(f"certify.{key}={used:g}")
    return out


def _certifiable(report: dict, cfg: GuardrailConfig) -> tuple[bool, str]:
    """Every deployment family certifiable, by certify's own refusal rule, applied with thresholds at
    least as strict as ours (a looser certification is refused, not re-judged); a family the report
    does not cover, or one it names that deployment does not know, fails it."""
    fams = report["families"]
    used = report.get("config", {})
    looser = looser_thresholds(used, cfg)
    if looser:
        return False, (f"certified with {'; '.join(looser)}: certify again with release's thresholds (min_ess, "
                       "max_khat and min_labels may be loosened at release with --guardrail NAME=VALUE)")
    missing, strange = [f for f in V.FAMILIES if f not in fams], sorted(set(fams) - set(V.FAMILIES))
    if missing or strange:
        return False, UNKNOWN + "; ".join(([f"no evidence for {', '.join(missing)}"] if missing else [])
                                          + ([f"families deployment does not have: {', '.join(strange)}"]
                                             if strange else []))
    weak = [f"{f} ({r['reason']})" for f, r in fams.items() if not r["certifiable"]]
    if weak:
        return False, "not certifiable: " + ", ".join(weak)
    ess = [r["ess"] for r in fams.values()  # the expert set's, where it took part: not a labels-only family's
           if r.get("ess") is not None and (r.get("evidence_weights") or {"expert_set": 1}).get("expert_set")]
    return True, f"every family certifiable (min_ess {used['min_ess']:g}), min ESS " + \
        (f"{min(ess):.1f}" if ess else "n/a (labels on the policy's own samples)")


def expert_set_sha256(report: dict) -> str | None:
    """The content hash of the expert set a report was certified on (None when it does not say)."""
    return (report.get("input_sha256") or {}).get("gold")


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


def evaluate(report: dict, cfg: GuardrailConfig = GuardrailConfig(),
             champion: dict | None = None) -> dict[str, tuple[bool, str]]:
    """Each guardrail's (passed, reason) for a certification `report` (rlhf_mlflow.certify format).
    `champion` is the current champion's report (or None when there is none yet). A guardrail whose
    evidence is missing fails with a reason starting `unknown: ` (unless waived: WAIVABLE)."""
    out = {"certifiable": _certifiable(report, cfg), "balanced_gain": _balanced_gain(report["balanced"], cfg),
           "family_change": _family_change(report["families"], cfg), "family_kl": _family_kl(report["families"], cfg),
           "marker_collapse": _marker_collapse(report, cfg), "beats_champion": _beats_champion(report, champion, cfg)}
    for name in cfg.waived():
        ok, why = out[name]
        if not ok and why.startswith(UNKNOWN):
            out[name] = (True, f"waived ({why})")
    return out


def _balanced_gain(bal: dict, cfg: GuardrailConfig) -> tuple[bool, str]:
    if not bal["certifiable"]:
        return False, f"balanced quality not certifiable ({bal['reason']})"
    if bal["gain"] is None:
        return False, UNKNOWN + "no reference quality to gain over (certified without the expert set)"
    ok = bal["gain"] >= cfg.min_balanced_gain
    ok_sig = not cfg.require_significant_gain or bal["gain_lo"] > 0
    return ok and ok_sig, (f"balanced gain {_fmt(bal['gain'])} [{_fmt(bal['gain_lo'])}, {_fmt(bal['gain_hi'])}] "
                           f"vs required {cfg.min_balanced_gain:+.3f}" + ("" if ok_sig else "; interval includes zero"))


def _family_change(fams: dict, cfg: GuardrailConfig) -> tuple[bool, str]:
    worse = [f"{f} {_fmt(fams[f]['gain'])}" for f in V.FAMILIES
             if f in fams and fams[f]["gain"] is not None and fams[f]["gain"] < cfg.min_family_change]
    unknown = [f for f in V.FAMILIES if f not in fams or fams[f]["gain"] is None]
    if worse or unknown:
        return False, "; ".join(([f"worse than the reference: {', '.join(worse)}"] if worse else [])
                                + ([f"change unknown: {', '.join(unknown)}"] if unknown else []))
    lowest = min(V.FAMILIES, key=lambda f: fams[f]["gain"])
    return True, f"lowest family change {lowest} {_fmt(fams[lowest]['gain'])}"


def _family_kl(fams: dict, cfg: GuardrailConfig) -> tuple[bool, str]:
    kls = {f: fams[f].get("kl") if f in fams else None for f in V.FAMILIES}
    unmeasured = [f for f, kl in kls.items() if not isinstance(kl, (int, float)) or kl != kl]
    far = [f"{f} {kl:.2f}" for f, kl in kls.items() if f not in unmeasured and kl > cfg.max_family_kl]
    if far:
        return False, f"KL above {cfg.max_family_kl:g}: {', '.join(far)}"
    if unmeasured:
        return False, UNKNOWN + f"no KL measured for {', '.join(unmeasured)} (it needs the policy's log-probs)"
    top = max(kls, key=kls.get)
    return True, f"max family KL {top} {kls[top]:.2f} <= {cfg.max_family_kl:g}"


def _marker_collapse(report: dict, cfg: GuardrailConfig) -> tuple[bool, str]:
    if report.get("shortcut_rules") is None:
        return False, UNKNOWN + ("no diagnostic: the certification counted no flagged shortcut (certify "
                                 "--diagnostic F)")
    collapsed, checked = [], 0
    for f, r in report["families"].items():
        for s in r.get("shortcuts", []):
            checked += 1
            if s["policy_count"] - s["reference_count"] > cfg.max_marker_increase:
                collapsed.append(f"{f} {SR.describe(s)} {s['reference_count']:.2f}->{s['policy_count']:.2f}")
    if collapsed:
        return False, "collapse onto flagged shortcuts: " + ", ".join(collapsed)
    return True, f"{checked} flagged shortcut(s) within +{cfg.max_marker_increase:g} of the reference"


def _beats_champion(report: dict, champion: dict | None, cfg: GuardrailConfig) -> tuple[bool, str]:
    bal = report["balanced"]
    if champion is None:
        return True, "no current champion"
    if expert_set_sha256(report) is None or expert_set_sha256(report) != expert_set_sha256(champion):
        return False, ("cannot compare with the champion: its certification and this one were not made on the "
                       f"same expert set (sha256 {str(expert_set_sha256(champion))[:12]} vs "
                       f"{str(expert_set_sha256(report))[:12]}); certify both on one expert set")
    if not bal["certifiable"] or not champion["balanced"]["certifiable"]:
        return False, "cannot compare with the champion: a balanced estimate is missing"
    c = champion["balanced"]["estimate"]
    return bal["estimate"] > c + cfg.champion_margin, f"certified balanced {bal['estimate']:.3f} vs champion {c:.3f}"


SHORT = {"min_balanced_gain": "gain", "require_significant_gain": "sig", "min_family_change": "change",
         "min_ess": "ess", "max_khat": "khat", "min_labels": "labels", "max_family_kl": "kl",
         "max_marker_increase": "marker", "champion_margin": "margin", "waive": "waive", "level": "level",
         "ess_widening": "ess_w", "label_widening": "label_w", "family_correlation": "corr"}
TAG = "non_default"
TAG_WIDTH = 30
"""MLflow's registry list shows a version's tag as `key: value`, whole up to about this many characters."""


def non_default_tag(loosened: list[str]) -> str | None:
    """The value of a version's `non_default` tag naming, briefly, every non-default threshold it was
    released under (non_default's `name=value` items; certify's as `c.name`), `+N` for those that do not
    fit in TAG_WIDTH with the key; None when there are none."""
    names = []
    for item in loosened:
        name = item.split("=", 1)[0]
        short = SHORT.get(name.removeprefix("certify."), name.removeprefix("certify."))
        names.append(("c." if name.startswith("certify.") else "") + short)
    if not names:
        return None
    room = TAG_WIDTH - len(TAG) - 2
    for k in range(len(names), 0, -1):
        text = ",".join(names[:k]) + (f"+{len(names) - k}" if k < len(names) else "")
        if len(text) <= room:
            return text
    return f"{len(names)} thresholds"
