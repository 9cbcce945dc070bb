"""`mlflow ui --app-name rlhf` (or `mlflow server --app-name rlhf`): MLflow's own server and UI, whose
first screen shows what this project logs.

MLflow 3.17's UI keeps its GenAI / "Model training" switch in the browser (localStorage
`mlflow.workflowType_v1`, GenAI when unset; an experiment's `mlflow.experimentKind` tag is not read
while the switch exists), so a new browser opens every experiment on a GenAI overview with no runs, and
the assistant's panel takes a third of the screen. This app is MLflow's, registered under MLflow's
`mlflow.app` plugin group (pyproject.toml) like MLflow's own `basic-auth`; its one change is a script
in the UI's index page that sets those settings' defaults: model training, assistant closed. A choice
the user made in that browser is kept. `served` runs it on a store, for the browser tests and
scripts/screenshots.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULTS = {"mlflow.workflowType_v1": "machine_learning", "mlflow.assistant.panelOpen_v1": False,
            "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True}
BOOTSTRAP = ("<script>(function(){try{var d=" + json.dumps(DEFAULTS) + ";for(var k in d){"
             "if(window.localStorage.getItem(k)===null){window.localStorage.setItem(k,JSON.stringify(d[k]));}}"
             "}catch(e){}})();</script>")


def with_defaults(response):
    """Flask after-request hook: the UI's index page gets the defaults script before its own."""
    if response.status_code != 200 or response.mimetype != "text/html":
        return response
    response.direct_passthrough = False
    body = response.get_data(as_text=True)
    if "</head>" in body and BOOTSTRAP not in body:
        response.set_data(body.replace("<head>", "<head>" + BOOTSTRAP, 1))
        for header in ("ETag", "Last-Modified"):  # the page differs from the file on disk
            response.headers.pop(header, None)
    return response


def create_app():
    """MLflow's server app (the FastAPI wrapper under uvicorn, as `mlflow server` runs it by default,
    else the Flask app) with the defaults script."""
    from mlflow.environment_variables import _MLFLOW_SGI_NAME
    from mlflow.server import app

    app.after_request(with_defaults)
    if _MLFLOW_SGI_NAME.get() == "uvicorn":
        from mlflow.server.fastapi_app import create_fastapi_app
        return create_fastapi_app(app)
    return app


@contextmanager
def served(store_uri: str, cwd: str, timeout: float = 120) -> Iterator[str]:
    """`mlflow server --app-name rlhf` on `store_uri`, on a free loopback port, run from `cwd` (with
    this interpreter); yields its URL once /health answers, and stops it on exit. RuntimeError when it
    does not answer within `timeout` seconds."""
    from rlhf_mlflow.tracking.server import free_port, server_env
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--app-name", "rlhf", "--backend-store-uri",
                             store_uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            cwd=os.fspath(cwd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=server_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"mlflow server --app-name rlhf did not answer /health within {timeout:.0f} s")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
