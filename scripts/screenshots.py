"""The README's pictures of MLflow's UI, taken from a store `make run` filled, so they cannot drift from it:

    .venv/bin/python scripts/screenshots.py [--store sqlite:///mlflow.db] [--out docs]    # or: make screenshots

Serves the store with `mlflow server --app-name rlhf` (127.0.0.1, a free port), opens each page in
Debian's Chromium (`apt-get install chromium`), headless, in a profile that never saw this UI (as a
newcomer's browser), and writes, each whole or not at all:
- `ui-experiment.png`: the experiment of the newest `main` run, its first screen;
- `ui-candidates.png`: the candidates view its description links to (each candidate's verdict);
- `ui-registry.png`: the registered model `rlhf-policy`, the champion named first.
`--store` defaults to MLFLOW_TRACKING_URI, else the checkout's mlflow.db (history.use_project_store).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
WINDOW = "1600,1000"
RENDER_MS = 15000
"""Virtual time the page gets to fetch and render before the shot (Chromium's --virtual-time-budget)."""
MIN_BYTES = 10_000
"""A rendered page's PNG is larger than this; a blank one is smaller."""


def chromium_binary() -> str:
    """Chromium's path; RuntimeError naming the package when it is not installed."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise RuntimeError("no chromium on PATH (Debian: apt-get install chromium)")
    return found


def chromium(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Headless Chromium with `args`, in a fresh profile removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="rlhf-chromium-") as profile:
        return subprocess.run([chromium_binary(), *FLAGS, f"--user-data-dir={profile}", f"--window-size={WINDOW}",
                               f"--virtual-time-budget={RENDER_MS}", *args],
                              capture_output=True, text=True, timeout=timeout)


def shoot(url: str, path: str) -> None:
    """A screenshot of `url` at `path`: taken beside it, then renamed over it once it is a rendered page."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        chromium([f"--screenshot={tmp}", url])
        size = os.path.getsize(tmp)
        if size < MIN_BYTES:
            raise RuntimeError(f"{url} rendered as a blank page ({size} bytes)")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is no mode for a file the docs show
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def pages(store_uri: str) -> dict[str, str]:
    """{file name: the UI's fragment} for the newest `main` run of the store."""
    import mlflow

    from rlhf_mlflow.tracking import experiment_view as EV
    from rlhf_mlflow.tracking.registry import REGISTERED_MODEL
    runs = mlflow.MlflowClient(store_uri).search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(store_uri).search_experiments()],
        "tags.`rlhf.step` = 'main'", order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise RuntimeError(f"no main run in {store_uri}: run `make run` first")
    exp = runs[0].info.experiment_id
    return {"ui-experiment.png": f"#/experiments/{exp}", "ui-candidates.png": EV.view_link(exp),
            "ui-registry.png": f"#/models/{REGISTERED_MODEL}"}


def take(store_uri: str, out: str) -> list[str]:
    """Every page's screenshot from `store_uri` into `out`; returns the paths written."""
    from rlhf_mlflow.tracking.ui_app import served
    chromium_binary()  # before the server starts
    wanted = pages(store_uri)
    written = []
    with tempfile.TemporaryDirectory(prefix="rlhf-ui-") as cwd, served(store_uri, cwd) as url:
        for name, fragment in wanted.items():
            path = os.path.join(out, name)
            shoot(f"{url}/{fragment}", path)
            written.append(path)
    return written


def store_uri(given: str | None) -> str:
    """`given` (a relative sqlite path made absolute: the server runs elsewhere), else the project's store."""
    import mlflow

    from rlhf_mlflow.tracking.history import use_project_store
    from rlhf_mlflow.tracking.workers import absolute_tracking_uri
    if given is None:
        use_project_store()
    else:
        mlflow.set_tracking_uri(given)
    return absolute_tracking_uri()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="tracking URI (default: MLFLOW_TRACKING_URI, else the checkout's mlflow.db)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "docs"), help="directory for the PNGs (default: docs/)")
    args = parser.parse_args(argv)
    from rlhf_mlflow.core.errors import InputError
    try:
        for path in take(store_uri(args.store), args.out):
            print(path)
    except (InputError, RuntimeError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
