"""Versions of `rlhf-policy` whose model lives elsewhere: a policy trained by another stack, registered
from any MLflow model URI or path, its run the certify run that certified it from a table of its
samples (steps/certify_table.py), its tags the evidence's lineage."""
from __future__ import annotations

import mlflow

from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.tracking.registry import REGISTERED_MODEL, client


def register_external(recipe: str, model_uri: str, run_id: str, input_sha256: dict[str, str]) -> str:
    """A new version of `rlhf-policy` whose model lives elsewhere (`model_uri`: any MLflow model URI or
    path), its run the certify run that certified it from its samples, its tags the evidence's lineage;
    returns the version."""
    c = client()
    try:
        c.create_registered_model(REGISTERED_MODEL)
    except mlflow.exceptions.MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another writer made it first
            raise
    tags = {"recipe": recipe, "external": "true",
            **{f"{k}_sha256": v[:16] for k, v in input_sha256.items() if k in ("samples", "labels")}}
    try:
        mv = c.create_model_version(REGISTERED_MODEL, source=model_uri, run_id=run_id, tags=tags)
    except mlflow.exceptions.MlflowException as e:
        raise InputError(f"--model-uri {model_uri}: MLflow refused it as a model version's source "
                         f"({str(e).splitlines()[0]})") from None
    return str(mv.version)


def unregister(version: str) -> None:
    """Delete a version register_external made, when the run that made it failed before certifying it."""
    client().delete_model_version(REGISTERED_MODEL, str(version))
