"""The portable commands, on plain paths in the seed's layout and without MLflow:

    python -m rlhf_mlflow.certify --policy D --reference D --gold F --out F [--rm-dir D ...] [--policy-labels F]
                                  [--policy-impl M:F] [--reward-impl M:F]
    python -m rlhf_mlflow.diagnostic --rm-dir D --policy-dir D --prompts F [--gold F] --out F
                                     [--policy-impl M:F] [--reward-impl M:F]
    python -m rlhf_mlflow.certify_table --samples F --labels F [--expert-set F] [--diagnostic F] --out F
    python -m rlhf_mlflow.label_requests --policy D --reference D --gold F --per-family K --out F [--policy-impl M:F]
    python -m rlhf_mlflow.label_requests --samples F --per-family K --out F
    python -m rlhf_mlflow.repair_rm --rm-dir D --qa F [--gold F] --labels F [F ...] [--diagnostic F]
                                    [--policy-dir D --prompts F] --out D [--overwrite]

Same computation as the `certify` and `diagnostic` steps (evidence/ and decisions/), JSON to --out; bad
input prints `error: ...` and exits 2, with no output file. `--policy-impl` / `--reward-impl` name a factory
('package.module:factory', called with --policy / --rm-dir) that opens a model of another implementation
of the model protocol (core/protocol.py) instead of our checkpoint. The repair's --out directory follows
the one output rule (core/files.py): new or empty, or with --overwrite another repair's (its
.rlhf_run.json says so).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from rlhf_mlflow.core.config import check_range, check_seed
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.files import atomic_write_json, atomic_write_text, check_out_dir, check_out_is_free, check_writable
from rlhf_mlflow.training.repair_rm import STEP as REPAIR
from rlhf_mlflow.training.repair_rm import RepairConfig as RepairDefaults

IMPL_HELP = ("import path 'package.module:factory' of a factory called with the {} location that returns a {} "
             "of the model protocol (core/protocol.py); default: our checkpoint format")


def _impl_options(ap: argparse.ArgumentParser, reward: bool = True) -> None:
    ap.add_argument("--policy-impl", default=None, help=IMPL_HELP.format("policy", "policy"))
    if reward:
        ap.add_argument("--reward-impl", default=None, help=IMPL_HELP.format("reward model", "reward model"))


def _certify_config_options(ap: argparse.ArgumentParser) -> None:
    """The CertifyConfig options certify and certify_table share (read back by _certify_config)."""
    ap.add_argument("--min-labels", type=int, default=20, help="labels a family needs to be certified from them")
    ap.add_argument("--label-looks", type=int, default=1, help="rounds of labels looked at (union bound)")
    ap.add_argument("--label-spending", default="", help="or shares of the error budget per look (e.g. 0.7,0.1,0.1,0.1)")
    ap.add_argument("--label-look", type=int, default=1, help="with --label-spending: which look this is (yours to count)")
    ap.add_argument("--seed", type=int, default=0)


def _certify_config(a: argparse.Namespace):
    from rlhf_mlflow.decisions.certify import CertifyConfig
    return CertifyConfig(seed=a.seed, min_labels=a.min_labels, label_looks=a.label_looks, label_spending=a.label_spending,
                         label_look=a.label_look)


def certify_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_mlflow.certify",
                                 description="Off-policy certification of a policy's true quality per family.")
    ap.add_argument("--policy", required=True, help="policy checkpoint directory")
    ap.add_argument("--reference", required=True, help="reference policy directory (the expert set's sampler)")
    ap.add_argument("--gold", required=True, help="expert set: labelled JSONL of reference samples")
    ap.add_argument("--out", required=True, help="where to write the certification JSON")
    ap.add_argument("--rm-dir", default=None, help="reward model directory (enables the doubly-robust estimate)")
    ap.add_argument("--correction", default=None, help="reward wrapper applied to the reward model's scores")
    ap.add_argument("--diagnostic", default=None, help="diagnostic evidence JSON (shortcut counts)")
    ap.add_argument("--pilot-prompts", default=None, help="prompt file whose family mix defines `pilot`")
    ap.add_argument("--policy-labels", default=None, help="expert labels on the policy's own responses (JSONL)")
    _certify_config_options(ap)
    _impl_options(ap)
    a = ap.parse_args(argv)

    def work() -> dict:
        from rlhf_mlflow.evidence.certify import certify
        return certify(a.policy, a.reference, a.gold, rm_dir=a.rm_dir, correction=a.correction,
                       diagnostic=a.diagnostic, pilot_prompts=a.pilot_prompts, cfg=_certify_config(a),
                       policy_labels=a.policy_labels,
                       policy_impl=a.policy_impl, reward_impl=a.reward_impl)
    return _run(work, a)


def certify_table_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_mlflow.certify_table",
                                 description="Certify a policy trained anywhere from a table of its samples and "
                                             "expert labels on some of them (decisions/table_certify.py).")
    ap.add_argument("--samples", required=True, help="the policy's samples: JSONL, CSV or Parquet (id, family, prompt "
                                                     "or attrs, response, score[, logp_policy, logp_reference])")
    ap.add_argument("--labels", required=True, help="expert labels on some samples: id, label")
    ap.add_argument("--expert-set", default=None, help="labelled reference samples (the reference's quality)")
    ap.add_argument("--diagnostic", default=None, help="diagnostic evidence JSON (shortcut counts)")
    ap.add_argument("--out", required=True, help="where to write the certification JSON")
    _certify_config_options(ap)
    a = ap.parse_args(argv)

    def work() -> dict:
        import os

        from rlhf_mlflow.decisions.table_certify import table_report
        inputs = {k: os.path.abspath(v) for k, v in vars(a).items()
                  if k in ("samples", "labels", "expert_set", "diagnostic") and v}
        return table_report(inputs, _certify_config(a))
    return _run(work, a)


def label_requests_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_mlflow.label_requests",
                                 description="The policy's own responses on the expert set's prompts, to be labelled "
                                             "(or rows of a table of its samples: --samples).")
    ap.add_argument("--samples", default=None, help="a table of the policy's samples (instead of the three below)")
    ap.add_argument("--policy", default=None, help="policy checkpoint directory")
    ap.add_argument("--reference", default=None, help="reference policy directory (the expert set's sampler)")
    ap.add_argument("--gold", default=None, help="expert set: labelled JSONL whose prompts are used")
    ap.add_argument("--per-family", type=int, required=True, help="requests per family")
    ap.add_argument("--families", default=None, help="comma-separated families (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="where to write the requests (JSONL)")
    _impl_options(ap, reward=False)
    a = ap.parse_args(argv)

    if bool(a.samples) == bool(a.policy and a.reference and a.gold):
        ap.error("give --samples, or --policy, --reference and --gold")

    def work() -> list[dict]:
        from rlhf_mlflow.core import records as D
        from rlhf_mlflow.core.own_models import open_policy
        from rlhf_mlflow.decisions.label_requests import draw_table_requests
        from rlhf_mlflow.evidence.label_requests import draw_requests
        check_range("--per-family", a.per_family, 1, 10_000, integer=True)
        families = [f.strip() for f in a.families.split(",")] if a.families else None
        if a.samples:
            from rlhf_mlflow.core.tables import read_samples
            return draw_table_requests(read_samples(a.samples), a.per_family, families, a.seed)
        open_policy(a.reference)  # checked, like certify's reference
        gold = D.read_jsonl(a.gold, labelled=True, scale=D.EXPERT)
        return draw_requests(open_policy(a.policy, a.policy_impl), gold, a.per_family,
                             families, a.seed)
    return _run(work, a, jsonl=True)


def diagnostic_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_mlflow.diagnostic",
                                 description="Gold-free reward-shortcut audit per family (decisions/diagnostic.py).")
    ap.add_argument("--rm-dir", required=True)
    ap.add_argument("--policy-dir", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gold", default=None,
                    help="optional expert set (labelled reference samples): credits what its labels show to be correctness")
    ap.add_argument("--n-prompts", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    _impl_options(ap)
    a = ap.parse_args(argv)

    def work() -> dict:
        from rlhf_mlflow.evidence.diagnostic import run_diagnostic
        check_range("--n-prompts", a.n_prompts, 2, 10_000, integer=True)
        check_seed("--seed", a.seed)
        return run_diagnostic(a.rm_dir, a.policy_dir, a.prompts, a.n_prompts, a.seed, gold_path=a.gold,
                              policy_impl=a.policy_impl, reward_impl=a.reward_impl)
    return _run(work, a)


def repair_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_mlflow.repair_rm",
                                 description="Repair a reward model with expert labels (training/repair_rm.py); "
                                             "writes a seed-format reward-model directory.")
    ap.add_argument("--rm-dir", required=True, help="the parent reward model directory")
    ap.add_argument("--qa", required=True, help="the crowd's QA sample (labelled JSONL, e.g. reward_model/train.jsonl)")
    ap.add_argument("--gold", default=None, help="the expert set (labelled reference samples, data/gold_calib.jsonl)")
    ap.add_argument("--labels", required=True, nargs="+",
                    help="every expert labels file bought on policies' own responses (labels on the expert scale: "
                         "finite, in [-1, 2])")
    ap.add_argument("--diagnostic", default=None, help="diagnostic evidence JSON: its flagged shortcuts' premiums "
                                                        "are taken out of the crowd's labels")
    ap.add_argument("--policy-dir", default=None, help="the reference policy: with --prompts, its responses "
                                                        "scored by the parent are the repair's anchors (as repair-rm)")
    ap.add_argument("--prompts", default=None, help="training prompts for the anchors (JSONL)")
    ap.add_argument("--out", required=True, help="the repaired reward model's directory (new or empty)")
    ap.add_argument("--overwrite", action="store_true", help="replace another repair's directory at --out "
                                                              "(its .rlhf_run.json says so; never other files)")
    ap.add_argument("--epochs", type=int, default=RepairDefaults.epochs)
    ap.add_argument("--lr", type=float, default=RepairDefaults.lr)
    ap.add_argument("--crowd-weight", type=float, default=RepairDefaults.crowd_weight)
    ap.add_argument("--ensemble", type=int, default=0, help="ensemble members written to OUT/ensemble (as repair-rm)")
    ap.add_argument("--label-head", choices=["on", "off"], default="on",
                    help="fit a label head on the expert labels, stacked on the fine-tuned model (as repair-rm)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    def work() -> dict:
        from rlhf_mlflow.decisions.correction import fit_corrections
        from rlhf_mlflow.decisions.label_requests import read_label_files
        from rlhf_mlflow.training import repair_rm as RR
        from rlhf_mlflow.core import records as D
        from rlhf_mlflow.core import reward_model as R
        from rlhf_mlflow.core.errors import read_json
        from rlhf_mlflow.training.rm_ensemble import ensemble_for_repair
        cfg = RR.RepairConfig(epochs=a.epochs, lr=a.lr, crowd_weight=a.crowd_weight, ensemble=a.ensemble,
                              label_head=a.label_head == "on", seed=a.seed)
        qa = D.read_jsonl(a.qa, labelled=True, scale=D.CROWD)
        rules = fit_corrections(read_json(a.diagnostic), qa, a.diagnostic) if a.diagnostic else []
        gold = D.read_jsonl(a.gold, labelled=True, scale=D.EXPERT) if a.gold else []
        experts = gold + read_label_files(a.labels)
        _, rm_config = R.load_rm(a.rm_dir)
        anchors = RR.anchor_rows(a.rm_dir, a.policy_dir, D.read_jsonl(a.prompts), cfg.anchors, rules, cfg.seed) \
            if a.policy_dir and a.prompts else []
        rm, info = RR.repair(a.rm_dir, qa, experts, rules, cfg, anchors=anchors)
        members = ensemble_for_repair(a.rm_dir, qa, experts, rules, cfg, anchors)
        RR.save_repaired(rm, rm_config, qa, info, a.out, members)  # marked as a repair without a run
        return info
    return _run(work, a, directory=REPAIR)


def _run(work: Callable[[], dict | list[dict]], a: argparse.Namespace, jsonl: bool = False,
         directory: str | None = None) -> int:
    """`work()` written to --out, which must be no input path of the command's and lie in no world
    (`directory`: the command whose work writes the directory --out itself, by the one output rule;
    its result is not written)."""
    from rlhf_mlflow.core.process import configure_threads
    configure_threads()
    out = a.out
    reads = {f"--{k.replace('_', '-')}": v for k, v in vars(a).items() if k != "out" and isinstance(v, str)}
    reads.update({f"--labels[{i}]": v for i, v in enumerate(getattr(a, "labels", None) or [])})
    try:
        check_out_is_free(out, reads)
        if directory:
            check_out_dir(out, directory, overwrite=a.overwrite)
        else:
            check_writable(out)
        result = work()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if directory:
        return 0
    if jsonl:
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in result))
    else:
        atomic_write_json(out, result)
    return 0
