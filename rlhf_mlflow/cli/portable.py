"""The portable commands, on plain paths in the seed's layout and without MLflow:

    python -m rlhf_mlflow.certify --policy D --reference D --gold F --out F [--rm-dir D ...]
    python -m rlhf_mlflow.diagnostic --rm-dir D --policy-dir D --prompts F --out F

Same computation as the `certify` and `diagnostic` steps (decisions/), JSON to --out; bad input prints
`error: ...` and exits 2, with no output file.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.files import atomic_write_json, check_writable


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
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    def work() -> dict:
        from rlhf_mlflow.decisions.certify import CertifyConfig, certify
        return certify(a.policy, a.reference, a.gold, rm_dir=a.rm_dir, correction=a.correction,
                       diagnostic=a.diagnostic, pilot_prompts=a.pilot_prompts, cfg=CertifyConfig(seed=a.seed))
    return _run(work, a.out)


def diagnostic_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_mlflow.diagnostic",
                                 description="Gold-free reward-shortcut audit per family (decisions/diagnostic.py).")
    ap.add_argument("--rm-dir", required=True)
    ap.add_argument("--policy-dir", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-prompts", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    def work() -> dict:
        from rlhf_mlflow.decisions.diagnostic import run_diagnostic
        return run_diagnostic(a.rm_dir, a.policy_dir, a.prompts, a.n_prompts, a.seed)
    return _run(work, a.out)


def _run(work: Callable[[], dict], out: str) -> int:
    from rlhf_mlflow.core.process import configure_threads
    configure_threads()
    try:
        check_writable(out)
        result = work()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write_json(out, result)
    return 0
