"""The local files of the active tracking store (its database, its artifact roots): what no step's
output path may be, hold or lie inside (core/files.check_out_is_free). A remote store's files are not
on this machine and are not listed."""
from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

import mlflow
from mlflow.entities import ViewType

from rlhf_mlflow.tracking.workers import absolute_tracking_uri

DEFAULT_ROOTS = ("mlruns", "mlartifacts")
"""MLflow's default artifact root (./mlruns) and a local server's (./mlartifacts)."""


def _local(uri: str) -> str | None:
    """The local path of a file: URI or a plain path; None for any other scheme."""
    if uri.startswith("file:"):
        return unquote(urlparse(uri).path)
    return uri if "://" not in uri and ":" not in uri.split("/")[0] else None


def store_paths() -> list[tuple[str, str]]:
    """(what, path) for each local file or directory of the active tracking store: a file store's
    directory; a sqlite store's database, the default artifact roots beside it and in the current
    directory; and every experiment's local artifact location (and, laid out as <root>/<id>, its root).
    Reads the store only where it exists: asking creates none."""
    uri = absolute_tracking_uri()
    found: list[tuple[str, str]] = []
    if uri.startswith("sqlite:"):
        db = unquote(uri[len("sqlite:///"):].split("?")[0])
        found.append(("the tracking store's database", db))
        for base in dict.fromkeys((os.path.dirname(db), os.getcwd())):
            found += [("the tracking store's artifact root", os.path.join(base, n)) for n in DEFAULT_ROOTS]
        exists = os.path.isfile(db)
    else:
        root = _local(uri)
        if root is None:
            return found
        found.append(("the tracking store", root))
        exists = os.path.isdir(root)
    if exists:
        found += _experiment_roots(uri)
    return found


def _experiment_roots(uri: str) -> list[tuple[str, str]]:
    found = []
    for exp in mlflow.MlflowClient(uri).search_experiments(view_type=ViewType.ALL):
        path = _local(exp.artifact_location or "")
        if path:
            found.append((f"the artifact folder of experiment {exp.name!r}", path))
            if os.path.basename(path.rstrip("/")) == exp.experiment_id:
                found.append(("the tracking store's artifact root", os.path.dirname(path.rstrip("/"))))
    return found
