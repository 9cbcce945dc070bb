"""dev_eval, diagnostic and correction as MLflow runs: the tracked bodies the CLI commands and the
`main` pipeline share. Each takes plain paths and returns its result.

An `out` path is checked before the run starts and written inside it (whole or not at all), so a
failure to write it ends the run FAILED."""
from __future__ import annotations

from . import data as D
from .files import atomic_write_json, check_writable
from .tracking import runs as T


def run_dev_eval(policy: str, policy_ref: str, reward_model: str, prompts: str, gold: str | None = None,
                 n: int = 1, seed: int = 0, run_name: str | None = None, out: str | None = None) -> dict:
    """The seed's dev evaluation of a checkpoint directory or models:/ URI; metrics are linked to the
    policy's LoggedModel when it has one. `out` receives the metrics JSON."""
    from . import model as M
    from . import reward_model as R
    from .evaluate import dev_eval
    from .figures import family_bars
    from .tracking.policy_model import resolve_policy
    if out:
        check_writable(out)
    prompt_records = D.read_jsonl(prompts)
    gold_records = D.read_jsonl(gold, labelled=True) if gold else None
    params = {"policy": policy, "policy_ref": policy_ref, "reward_model": reward_model, "prompts": prompts,
              "gold": gold, "n": n, "seed": seed}
    with T.tracked_run("dev_eval", params, run_name=run_name):
        policy_dir, model_id = resolve_policy(policy)
        T.log_records_input(prompt_records, prompts, "dev")
        if gold:
            T.log_records_input(gold_records, gold, "gold")
        res = dev_eval(M.load_policy(policy_dir)[0], M.load_policy(policy_ref)[0], R.load_rm(reward_model)[0],
                       prompt_records, gold_records, n, seed)
        T.log_metrics(res.metrics, model_id=model_id)
        T.log_figure(family_bars(res.metrics, title=f"dev_eval: {policy}"), "figures/dev_eval_families.png")
        T.log_json_artifact(res.metrics, "dev_eval.json")
        if out:
            atomic_write_json(out, res.metrics)
    return res.metrics


def run_diagnostic_step(rm_dir: str, policy_dir: str, prompts: str, n_prompts: int = 24, seed: int = 0,
                        out: str | None = None) -> dict:
    """The gold-free shortcut audit; logs risk/<family>, flag/<family>, the evidence and a figure.
    `out` receives the result JSON."""
    from .diagnostic import run_diagnostic
    from .figures import diagnostic_bars
    if out:
        check_writable(out)
    params = {"rm_dir": rm_dir, "policy_dir": policy_dir, "prompts": prompts, "n_prompts": n_prompts, "seed": seed}
    with T.tracked_run("diagnostic", params, run_name="diagnostic"):
        result = run_diagnostic(rm_dir, policy_dir, prompts, n_prompts, seed)
        fams = result["families"]
        T.log_metrics({**{f"risk/{f}": v["risk"] for f, v in fams.items()},
                       **{f"flag/{f}": float(v["flag"]) for f, v in fams.items()}})
        T.log_json_artifact(result, "diagnostic.json")
        T.log_figure(diagnostic_bars(result), "figures/diagnostic.png")
        if out:
            atomic_write_json(out, result)
    return result


def run_correction(diagnostic: str | dict, qa: str, out: str) -> list[dict]:
    """Fit corrections for the flagged shortcuts on the QA sample; write and log the reward wrapper."""
    from .correction import fit_corrections, write_wrapper
    from .errors import read_json
    check_writable(out)
    result = read_json(diagnostic) if isinstance(diagnostic, str) else diagnostic
    qa_records = D.read_jsonl(qa, labelled=True)
    params = {"diagnostic": diagnostic if isinstance(diagnostic, str) else "(in memory)", "qa": qa}
    with T.tracked_run("correction", params, run_name="correction"):
        rules = fit_corrections(result, qa_records)
        sha256 = write_wrapper(rules, out)
        T.log_params({"reward_wrapper_sha256": sha256})
        T.log_artifact(out, "reward_wrapper")
        T.log_json_artifact(rules, "corrections.json")
    return rules

