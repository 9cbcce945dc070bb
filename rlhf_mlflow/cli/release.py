"""`rlhf-mlflow certify | release | grade | main`: certification, guarded release, the oracle's grade
and the whole story."""
from __future__ import annotations

import os
import time

import click

from rlhf_mlflow.cli.options import (
    SEED,
    Finite,
    echo_err,
    echo_json,
    given,
    guardrail_overrides,
    overwrite_option,
    resolve_world,
    world_option,
)
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.training.recipes import MAX_STEPS_SCALE, check_steps_scale


@click.command("certify")
@click.option("--model-version", default=None, help="Registered rlhf-policy version to certify.")
@click.option("--policy", default=None, help="Or a policy checkpoint directory (no registry link).")
@click.option("--world", default=None, help="Fixture directory that fills the inputs below (default: the default world).")
@click.option("--reference", default=None, help="Reference policy directory (default: <world>/policy).")
@click.option("--gold", default=None, help="Expert set JSONL (default: <world>/data/gold_calib.jsonl).")
@click.option("--rm-dir", default=None, help="Reward model for the doubly-robust estimate (default: <world>/reward_model).")
@click.option("--correction", default=None, help="Reward wrapper applied to the reward model's scores.")
@click.option("--diagnostic", default=None, help="Diagnostic evidence JSON: flagged shortcuts' counts are reported.")
@click.option("--pilot-prompts", default=None,
              help="Prompt file whose family mix defines `pilot` (default: <world>/data/prompts_dev.jsonl).")
@click.option("--min-ess", type=Finite(1, 1e9), default=10.0, show_default=True,
              help="Refuse families with fewer effective expert samples.")
@click.option("--max-khat", type=Finite(0, 1e3), default=0.7, show_default=True,
              help="Refuse families whose weight tail k-hat is above this.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the policy samples and bootstrap.")
@click.option("--policy-labels", default=None,
              help="Expert labels on the version's own responses (label-requests -> expert-label): families with "
                   "enough of them are certified from them.")
@click.option("--min-labels", type=click.IntRange(2, 1_000_000), default=20, show_default=True,
              help="Policy labels a family needs to be certified from them.")
@click.option("--label-looks", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Rounds of labels looked at so far: every interval is union-bounded over them.")
@click.option("--label-spending", default="", metavar="S1,S2,...",
              help="Or shares of the error budget per look, fixed before the first (e.g. 0.7,0.1,0.1,0.1; adding up "
                   "to at most 1): the look is counted from the store's certify runs of the version.")
@click.option("--out", default=None, help="Also write the certification JSON here.")
@click.option("--policy-impl", default=None, metavar="MODULE:FACTORY",
              help="Open the policy with another implementation of the model protocol (core/protocol.py): an "
                   "import path called with the policy's location.")
@click.option("--reward-impl", default=None, metavar="MODULE:FACTORY",
              help="The same for the reward model (called with --rm-dir).")
def certify_cmd(model_version, policy, world, reference, gold, rm_dir, correction, diagnostic, pilot_prompts,
                min_ess, max_khat, seed, policy_labels, min_labels, label_looks, label_spending, out, policy_impl, reward_impl):
    """Certify a policy's true quality per family from the expert set, as an MLflow run."""
    from rlhf_mlflow.decisions.certify import CertifyConfig
    from rlhf_mlflow.steps.certify import run_certify
    from rlhf_mlflow.steps.outputs import check_out
    if out:  # before the default world is built; the step checks again with its inputs
        check_out(out)
    if policy_labels:  # before the default world is built or a run starts; the step checks them against the requests
        from rlhf_mlflow.decisions.label_requests import read_labels
        read_labels(policy_labels)
    paths = None if (reference and gold) else resolve_world(world)
    res = run_certify(version=model_version, policy=policy, world=paths, reference=reference, gold=gold,
                      rm_dir=rm_dir, correction=correction, diagnostic=diagnostic, pilot_prompts=pilot_prompts,
                      cfg=CertifyConfig(min_ess=min_ess, max_khat=max_khat, seed=seed, min_labels=min_labels,
                                        label_looks=label_looks, label_spending=label_spending),
                      echo=echo_err, out=out, policy_labels=policy_labels, policy_impl=policy_impl,
                      reward_impl=reward_impl)
    echo_json({"run_id": res["run_id"], "balanced": res["report"]["balanced"]})


@click.command("release")
@click.option("--model-version", required=True, help="The rlhf-policy version to release.")
@click.option("--certification-run", default=None,
              help="Certify run to use (default: the version's certification.run_id tag); must certify this version.")
@click.option("--guardrails", default=None,
              help="Comma-separated key=value overrides of guardrail thresholds, e.g. 'max_family_kl=4,min_ess=20'.")
@click.option("--guardrail", "guardrail", multiple=True,
              help="One key=value guardrail threshold, repeatable (the spelling `sweep` takes).")
@click.option("--lock-wait", type=Finite(0, 86_400), default=600.0, show_default=True,
              help="Seconds to wait for another release of the model to finish (releases decide one at a time).")
@click.option("--trust-remote-evidence", type=click.BOOL, is_flag=False, flag_value=True, default=False,
              show_default=True,
              help="Release a certification whose inputs are not on this machine on its provenance alone, without "
                   "recomputing it (written on the version); inputs that are here but changed are refused anyway. "
                   "`--trust-remote-evidence` alone or `--trust-remote-evidence true|false`.")
def release_cmd(model_version, certification_run, guardrails, guardrail, lock_wait, trust_remote_evidence):
    """Promote a version to `champion` only if every guardrail passes; tag the version with each result."""
    from rlhf_mlflow.steps.release import run_release
    res = run_release(model_version, certification_run, guardrail_overrides(guardrails, guardrail), echo=echo_err,
                      lock_wait=lock_wait, trust_remote=trust_remote_evidence)
    echo_json({"decision": res["decision"], "run_id": res["run_id"],
               "guardrails": {k: {"pass": ok, "reason": why} for k, (ok, why) in res["guardrails"].items()}})


@click.command("grade")
@click.option("--model-version", required=True, help="The rlhf-policy version to grade.")
@click.option("--world", default=None, help="Synthetic world whose oracle grades it (default: the default world).")
@click.option("--n", type=click.IntRange(1, 1024), default=4, show_default=True, help="Samples per prompt.")
def grade_cmd(model_version, world, n):
    """The oracle's true quality per family (synthetic worlds only): truth/balanced, per family grade_families.json."""
    from rlhf_mlflow.steps.grade import run_grade
    echo_json(run_grade(model_version, resolve_world(world), n, echo=echo_err)["truth"])


@click.command("main")
@world_option
@click.option("--steps-scale", type=float, default=1.0, show_default=True,
              help=f"Multiply every recipe's steps (for a quick look; in (0, {MAX_STEPS_SCALE:g}]).")
@click.option("--out", default="outputs/main", show_default=True,
              help="Directory for the diagnostic evidence, the correction, the expert labels bought, each round's "
                   "reward model and the ceiling checkpoint (new or empty); main_state.json, main's marker, says "
                   "what main finished there.")
@click.option("--label-budget", type=click.IntRange(0, 1_000_000), default=1200, show_default=True,
              help="Expert labels main may buy on candidates' own responses and for repairs (0: certify from the "
                   "expert set only).")
@click.option("--rounds", type=click.IntRange(1, 20), default=2, show_default=True,
              help="1: the story on the world's reward model; each more round repairs the reward model with every "
                   "expert label so far and trains the corrected recipes on it (docs/REPAIR.md).")
@click.option("--guardrails", default=None, help="Comma-separated key=value guardrail thresholds for every release.")
@click.option("--guardrail", "guardrail", multiple=True, help="One key=value guardrail threshold, repeatable.")
@click.option("--resume", type=click.BOOL, is_flag=False, flag_value=True, default=False, show_default=True,
              help="Continue the main that stopped (SIGTERM, a crash) in --out, as a new main run tagged "
                   "rlhf.resumes: the labels it bought are reused and counted, its finished rounds, repairs, "
                   "candidates, releases and grades are not run again, a candidate cut short continues from its "
                   "last checkpoint. Options left out take its values; one given with another value is refused. "
                   "Without --resume an --out whose main did not finish is refused. `--resume` alone or "
                   "`--resume true|false` (as `mlflow run -P resume=true` passes it).")
@overwrite_option("the directory a finished main left", ", starting over (one that did not finish continues "
                  "only with --resume)")
@click.pass_context
def main_cmd(ctx, world, steps_scale, out, label_budget, rounds, guardrails, guardrail, resume, overwrite):
    """The whole story: history, diagnostic, correction, candidates, certify, release, grade, summary.

    A main that stopped (SIGTERM, a crash) continues with --resume and the same --out, without buying
    its labels again or redoing what it finished."""
    from rlhf_mlflow.steps.main import resume as MR
    from rlhf_mlflow.steps.main.run import run_main
    from rlhf_mlflow.steps.main.labels import purchases, purchases_markdown
    from rlhf_mlflow.steps.reports import rounds_markdown, story_markdown
    t0 = time.perf_counter()
    check_steps_scale(steps_scale)  # NaN, inf and 0 refused before anything; a resumed main's stored value below
    try:  # before the default world is built; run_main checks again with it
        out, state = MR.check_out(out, None, resume, overwrite)
    except MR.MainStateError as e:
        raise click.UsageError(str(e)) from None
    overrides = guardrail_overrides(guardrails, guardrail)
    try:
        if resume:
            world, steps_scale, label_budget, rounds, overrides = _resumed_settings(
                ctx, state.settings, (world, steps_scale, label_budget, rounds, overrides))
    except InputError as e:
        raise click.UsageError(str(e)) from None
    check_steps_scale(steps_scale)  # a resumed main's stored value too
    paths = resolve_world(world)
    from rlhf_mlflow.decisions.guardrails import GuardrailConfig
    GuardrailConfig.from_dict(overrides)  # a bad threshold is refused before any run
    if resume:
        problems = MR.mismatches(MR.resumable(out).settings, MR.settings(paths, steps_scale, label_budget, rounds, overrides))
        if problems:
            raise click.UsageError(str(MR.SettingsMismatch(problems)))
    table = run_main(paths, out, steps_scale, echo=echo_err, label_budget=label_budget,
                     guardrails=overrides, rounds=rounds, resume=resume, overwrite=overwrite)
    click.echo(story_markdown(table) + rounds_markdown(table.attrs.get("rounds") or [], table)
               + purchases_markdown(purchases(out)))
    click.echo(f"main finished in {time.perf_counter() - t0:.0f} s")


def _resumed_settings(ctx: click.Context, stored: dict, values: tuple) -> tuple:
    """(world, steps_scale, label_budget, rounds, guardrails): each option the command line left out
    takes the value of the main being resumed."""
    world, steps_scale, label_budget, rounds, overrides = values
    if not given(ctx, ["world"]):
        world = stored["world"]
        if not os.path.isdir(world):
            raise InputError(f"--world: the world the stopped main ran on, {world}, is gone: pass --world with it")
    steps_scale = steps_scale if given(ctx, ["steps_scale"]) else stored["steps_scale"]
    label_budget = label_budget if given(ctx, ["label_budget"]) else stored["label_budget"]
    rounds = rounds if given(ctx, ["rounds"]) else stored["rounds"]
    overrides = overrides if given(ctx, ["guardrails", "guardrail"]) else stored["guardrails"]
    return world, steps_scale, label_budget, rounds, overrides


COMMANDS = (certify_cmd, release_cmd, grade_cmd, main_cmd)
