"""The model registry side of certification and release: which certification belongs to which
version, guardrail results as version tags, and the `champion` alias.

Tags on a version of `rlhf-policy`:
  certification.run_id   the certify run whose `certification.json` covers exactly this version
  guardrail.<name>       "pass: <reason>" or "fail: <reason>", written by release
  release.decision       "promoted" or "refused"; release.run_id the release run
"""
from __future__ import annotations

import json
import tempfile

import mlflow

from ..errors import InputError
from .policy_model import REGISTERED_MODEL

CHAMPION = "champion"
CERT_ARTIFACT = "certification.json"


def client() -> mlflow.MlflowClient:
    return mlflow.MlflowClient()


def get_version(version: str | int, name: str = REGISTERED_MODEL):
    try:
        return client().get_model_version(name, str(version))
    except mlflow.exceptions.MlflowException:
        raise InputError(f"model version {name}/{version} does not exist") from None


def version_uri(version: str | int, name: str = REGISTERED_MODEL) -> str:
    return f"models:/{name}/{version}"


def champion_version(name: str = REGISTERED_MODEL):
    """The version the `champion` alias points at, or None."""
    try:
        return client().get_model_version_by_alias(name, CHAMPION)
    except mlflow.exceptions.MlflowException:
        return None


def load_certification(run_id: str) -> dict:
    """The certification report a certify run logged."""
    try:
        with tempfile.TemporaryDirectory() as d:
            path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=CERT_ARTIFACT, dst_path=d)
            with open(path) as f:
                return json.load(f)
    except mlflow.exceptions.MlflowException as e:
        raise InputError(f"run {run_id}: no {CERT_ARTIFACT} artifact ({str(e).splitlines()[0]})") from None


def certification_for(version, run_id: str | None = None, name: str = REGISTERED_MODEL) -> tuple[str, dict]:
    """(certify run id, report) certifying exactly `version`: from `run_id` when given, else the
    version's `certification.run_id` tag. Refuses a missing certification or one of another version."""
    run_id = run_id or version.tags.get("certification.run_id")
    if not run_id:
        raise InputError(f"{name} version {version.version} has no certification: run "
                         f"`rlhf-mlflow certify --model-version {version.version}` first")
    report = load_certification(run_id)
    subject = report.get("subject", {})
    if subject.get("registered_model") != name or str(subject.get("model_version")) != str(version.version):
        raise InputError(f"certification run {run_id} certifies {subject.get('registered_model')} version "
                         f"{subject.get('model_version')}, not {name} version {version.version}")
    return run_id, report


def set_tags(version: str | int, tags: dict, name: str = REGISTERED_MODEL) -> None:
    c = client()
    for k, v in tags.items():
        c.set_model_version_tag(name, str(version), k, str(v)[:4900])


def move_champion(version: str | int, name: str = REGISTERED_MODEL) -> None:
    client().set_registered_model_alias(name, CHAMPION, str(version))


def download_policy(version: str | int, name: str = REGISTERED_MODEL) -> tuple[str, str]:
    """(local checkpoint directory, LoggedModel id) of a registered policy version."""
    from .policy_model import resolve_policy
    return resolve_policy(version_uri(version, name))

