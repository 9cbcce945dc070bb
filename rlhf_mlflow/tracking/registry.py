"""The model registry side of certification and release: which certification belongs to which
version, the release decision on the version, and the `champion` alias.

A version of `rlhf-policy` carries few tags (the registry's page shows them all on every row); what a
release decided in full is its description (markdown) and its release run's `release.json`:
  recipe, world_hash       written when it is registered (train_rl)
  certification.run_id     the certify run whose `certification.json` covers exactly this version
  certification.sha256     sha256 of that artifact's bytes, as the certify run logged it
  release.decision         "refused", "promoting" (moving the alias), "promoted", or "superseded by vN"
                           once the alias moved on to version N
  release.run_id           the release run that decided it: its `release.json` holds every guardrail's
                           result, and its parameters (which cannot change once logged) the
                           certification run and sha256 it decided on (the champion is compared by them)
(label_requests.run_id too, on a version whose label requests were drawn.)
"""
from __future__ import annotations

import hashlib
import tempfile

import mlflow

from rlhf_mlflow.core.errors import InputError, parse_json
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking.policy_model import REGISTERED_MODEL

CHAMPION = "champion"
CERT_ARTIFACT = "certification.json"


def client() -> mlflow.MlflowClient:
    return mlflow.MlflowClient()


def get_version(version: str | int, name: str = REGISTERED_MODEL):
    try:
        return client().get_model_version(name, str(version))
    except mlflow.exceptions.MlflowException:
        raise InputError(f"model version {name}/{version} does not exist") from None


def version_for_world(version: str | int, world, name: str = REGISTERED_MODEL):
    """The version, refused when it was trained on another world than `world` (a WorldPaths, or None
    for no check): both carry the world's content hash (the version's `world_hash` tag, the world's
    manifest); a fixture built elsewhere has none and is not checked."""
    mv = get_version(version, name)
    trained = mv.tags.get("world_hash")
    manifest = world.manifest() if world is not None else None
    here = (manifest or {}).get("world_hash")
    if trained and here and trained != here:
        raise InputError(f"version {mv.version} was trained on world {trained}, but {world.root} is world {here}: "
                         f"pass the --world it was trained on (`rlhf-mlflow runs --step build_world` lists worlds "
                         f"by hash)")
    return mv


def version_uri(version: str | int, name: str = REGISTERED_MODEL) -> str:
    return f"models:/{name}/{version}"


def champion_version(name: str = REGISTERED_MODEL, alias: str = CHAMPION):
    """The version the `champion` alias (or `alias`) points at, or None."""
    try:
        return client().get_model_version_by_alias(name, alias)
    except mlflow.exceptions.MlflowException:
        return None


def load_certification(run_id: str) -> tuple[dict, str]:
    """The certification report a certify run logged, and the sha256 of its bytes."""
    try:
        with tempfile.TemporaryDirectory() as d:
            path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=CERT_ARTIFACT, dst_path=d)
            with open(path, "rb") as f:
                raw = f.read()
    except (mlflow.exceptions.MlflowException, OSError) as e:
        raise InputError(f"run {run_id}: no {CERT_ARTIFACT} artifact ({str(e).splitlines()[0]})") from None
    try:
        return parse_json(raw.decode("utf-8"), f"run {run_id}'s {CERT_ARTIFACT}"), hashlib.sha256(raw).hexdigest()
    except UnicodeDecodeError:
        raise InputError(f"run {run_id}: {CERT_ARTIFACT} is not UTF-8 text") from None


def certification_for(version, run_id: str | None = None, name: str = REGISTERED_MODEL) -> tuple[str, dict]:
    """(certify run id, report) certifying exactly `version`, from `run_id` when given, else the
    version's `certification.run_id` tag, after every provenance check (see verify_certification)."""
    run_id = run_id or version.tags.get("certification.run_id")
    if not run_id:
        raise InputError(f"{name} version {version.version} has no certification: run "
                         f"`rlhf-mlflow certify --model-version {version.version}` first")
    report, sha = load_certification(run_id)
    problem = verify_certification(version, run_id, report, sha, name)
    if problem:
        raise InputError(f"certification run {run_id} refused for {name} version {version.version}: {problem}")
    return run_id, report


PINNED = ("certification_run_id", "certification_sha256")
"""The release run's parameters naming the certification it decided on (release logs them)."""


def pinned_certification(version) -> tuple[str | None, str | None]:
    """(certify run id, sha256) the version's last release decided on: its release run's parameters
    (a store written before they existed: its `release.certification_*` tags), else (None, None)."""
    run_id = version.tags.get("release.run_id")
    params = {}
    if run_id:
        try:
            params = client().get_run(run_id).data.params
        except mlflow.exceptions.MlflowException:
            pass
    if params.get(PINNED[0]):
        return params[PINNED[0]], params.get(PINNED[1])
    return version.tags.get("release.certification_run_id"), version.tags.get("release.certification_sha256")


def champion_certification(champion, name: str = REGISTERED_MODEL) -> dict:
    """The report the champion was promoted on (the run and sha256 its release recorded then: a later
    change of its `certification.run_id` tag does not change what it is compared by)."""
    run_id, pinned = pinned_certification(champion)
    run_id = run_id or champion.tags.get("certification.run_id")
    if not run_id:
        raise InputError(f"the champion, {name} version {champion.version}, has no certification on record")
    report, sha = load_certification(run_id)
    if pinned and pinned != sha:
        raise InputError(f"the champion's certification ({run_id}) changed after it was promoted "
                         f"(sha256 {sha[:12]} vs {pinned[:12]} at promotion): fix the store before releasing")
    problem = verify_certification(champion, run_id, report, sha, name, check_tags=not pinned)
    if problem:
        raise InputError(f"the champion's certification run {run_id} fails its checks: {problem}")
    return report


def verify_certification(version, run_id: str, report: dict, sha: str, name: str = REGISTERED_MODEL,
                         check_tags: bool = True) -> str | None:
    """The first provenance check the certification fails, in words, or None. It must come from a
    FINISHED certify run, in the version's experiment or linked to its LoggedModel, whose parameters
    and report name exactly this version (and LoggedModel), whose logged metrics equal the report's
    numbers, and (with `check_tags`) whose artifact's sha256 is the version's `certification.sha256`."""
    try:
        run = client().get_run(run_id)
    except mlflow.exceptions.MlflowException:
        return "no such run"
    if run.data.tags.get("rlhf.step") != "certify":
        return f"it is not a certify run (rlhf.step = {run.data.tags.get('rlhf.step')!r})"
    if run.info.status != "FINISHED":
        return f"the certify run ended {run.info.status}, not FINISHED"
    if run.data.params.get("model_version") != str(version.version):
        return f"the certify run was for version {run.data.params.get('model_version')!r}"
    subject = report.get("subject", {})
    if subject.get("registered_model") != name or str(subject.get("model_version")) != str(version.version):
        return (f"its report certifies {subject.get('registered_model')} version {subject.get('model_version')}, "
                f"not {name} version {version.version}")
    model_id = getattr(version, "model_id", None)
    if model_id and subject.get("model_id") != model_id:
        return f"its report names LoggedModel {subject.get('model_id')}, not the version's {model_id}"
    if not _same_lineage(run, version, model_id):
        return "it is neither in the version's experiment nor linked to the version's LoggedModel"
    mismatch = _metric_mismatch(run.data.metrics, report)
    if mismatch:
        return f"the run's logged metrics disagree with its report ({mismatch})"
    if check_tags:
        tagged = version.tags.get("certification.sha256")
        if tagged != sha:
            return f"the artifact's sha256 {sha[:12]} is not the version's certification.sha256 {str(tagged)[:12]}"
    return None


LABEL_REQUESTS_SHA256 = "label_requests_sha256"


def label_requests_for(version, name: str = REGISTERED_MODEL) -> list[dict]:
    """The label requests logged for `version` (its `label_requests.run_id` tag), checked: a FINISHED
    label_requests run for this version whose artifact still has the sha256 the run logged as a parameter
    (in a store written before that: the version's `label_requests.sha256` tag)."""
    from rlhf_mlflow.core.records import check_record
    run_id = version.tags.get("label_requests.run_id")
    if not run_id:
        raise InputError(f"{name} version {version.version} has no label requests: run "
                         f"`rlhf-mlflow label-requests --model-version {version.version}` first")
    run = client().get_run(run_id)
    if run.data.tags.get("rlhf.step") != "label_requests" or run.info.status != "FINISHED" \
            or run.data.params.get("model_version") != str(version.version):
        raise InputError(f"run {run_id} is not a finished label_requests run for version {version.version}")
    with tempfile.TemporaryDirectory() as d:
        path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="label_requests.jsonl", dst_path=d)
        raw = open(path, "rb").read()
    logged = run.data.params.get(LABEL_REQUESTS_SHA256) or version.tags.get("label_requests.sha256")
    if hashlib.sha256(raw).hexdigest() != logged:
        raise InputError(f"the label requests of run {run_id} were changed after they were logged")
    where = f"label requests of run {run_id}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{where}: not UTF-8 text") from None
    return [check_record(parse_json(line, where, i), f"{where}:{i}", None)
            for i, line in enumerate(text.splitlines(), 1) if line.strip()]


def release_record(version) -> dict:
    """The `release.json` of the version's last release (every guardrail's result, the decision, the
    champion before it, the evidence), or {} when it was never released."""
    run_id = version.tags.get("release.run_id")
    if not run_id:
        return {}
    with tempfile.TemporaryDirectory() as d:
        path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="release.json", dst_path=d)
        with open(path, encoding="utf-8") as f:
            return parse_json(f.read(), f"run {run_id}'s release.json")


def versions_promoted(name: str = REGISTERED_MODEL) -> list:
    """Every version whose `release.decision` says promoted."""
    return [v for v in client().search_model_versions(f"name = '{name}'") if v.tags.get("release.decision") == "promoted"]


def _same_lineage(run, version, model_id: str | None) -> bool:
    try:
        source = client().get_run(version.run_id)
        if source.info.experiment_id == run.info.experiment_id:
            return True
    except mlflow.exceptions.MlflowException:
        pass
    if not model_id:
        return False
    model = client().get_logged_model(model_id)
    return any(m.run_id == run.info.run_id for m in (model.metrics or []))


def _metric_mismatch(metrics: dict, report: dict) -> str | None:
    groups = {"balanced": report.get("balanced", {})}  # certify logs the balanced estimate, per family a table
    for group, row in groups.items():
        est = row.get("estimate")
        name = f"{MN.CERTIFY}certified/{group}"
        logged = metrics.get(name)
        if est is None and logged is None:
            continue
        if est is None or logged is None or abs(float(est) - logged) > 1e-9:
            return f"{name}: logged {logged}, report {est}"
    return None


def set_tags(version: str | int, tags: dict, name: str = REGISTERED_MODEL) -> None:
    c = client()
    for k, v in tags.items():
        c.set_model_version_tag(name, str(version), k, str(v)[:4900])


def set_or_clear(version: str | int, key: str, value: str | None, name: str = REGISTERED_MODEL) -> None:
    """The version's tag `key` set to `value`, or removed when `value` is None (nothing stale left)."""
    if value is not None:
        set_tags(version, {key: value}, name)
    elif key in client().get_model_version(name, str(version)).tags:
        client().delete_model_version_tag(name, str(version), key)


FAILED = "failed."
"""A version's `failed.<guardrail>` tags: what the registry's list shows of a refusal (MLflow's UI cuts a
version's description there to its first 29 characters; a tag of up to 30 characters shows whole)."""


def set_failed(version: str | int, failed: dict[str, str], name: str = REGISTERED_MODEL) -> None:
    """One `failed.<guardrail>` tag per guardrail this release failed (a brief reason), none left from an
    earlier release of the version."""
    c = client()
    stale = [k for k in c.get_model_version(name, str(version)).tags
             if k.startswith(FAILED) and k[len(FAILED):] not in failed]
    for k in stale:
        c.delete_model_version_tag(name, str(version), k)
    set_tags(version, {FAILED + g: why for g, why in failed.items()}, name)


def describe(version: str | int | None, text: str, name: str = REGISTERED_MODEL) -> None:
    """The description the registry page shows: the version's (its verdict), or with no version the
    registered model's (left alone when it already says the same)."""
    c = client()
    if version is None:
        if c.get_registered_model(name).description != text:
            c.update_registered_model(name, description=text)
    else:
        c.update_model_version(name, str(version), description=text)


def move_champion(version: str | int, name: str = REGISTERED_MODEL, alias: str = CHAMPION) -> None:
    """Point `champion` (or `alias`) at the version and read it back (a writer that bypassed the release
    lock would show here)."""
    client().set_registered_model_alias(name, alias, str(version))
    now = champion_version(name, alias)
    if now is None or str(now.version) != str(version):
        raise RuntimeError(f"{alias} alias reads {now.version if now else None} right after moving it to {version}")


def download_policy(version: str | int, name: str = REGISTERED_MODEL) -> tuple[str, str]:
    """(local checkpoint directory, LoggedModel id) of a registered policy version."""
    from rlhf_mlflow.tracking.policy_model import resolve_policy
    return resolve_policy(version_uri(version, name))

