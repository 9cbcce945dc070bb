"""What a newcomer runs from the README, as they run it: each python snippet in a fresh interpreter, from
a directory outside the clone (MLFLOW_TRACKING_URI set) and from one inside it (unset: the clone's store),
with nothing on stderr and nothing left in that directory; and MLflow's default-experiment plugin, which
MLflow loads while `import mlflow` is still running, loading in an interpreter that imports this project
first (it used to warn of a circular import there and stay out of that process)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from click.testing import CliRunner

from rlhf_mlflow.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")


def readme_python_snippets() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def _fresh(code: str, cwd, tracking_uri: str | None) -> subprocess.CompletedProcess:
    """`code` in a new interpreter started in `cwd`, with the tracking URI given (or none)."""
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_ENV}
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _a_checkout(path) -> None:
    """`path` is an rlhf_mlflow checkout as far as the store lookup and the plugin can tell: its MLproject."""
    shutil.copy(os.path.join(ROOT, "MLproject"), path / "MLproject")


def test_every_readme_python_snippet_works_from_any_directory_without_a_warning(tmp_path, tmp_path_factory,
                                                                                 tiny_world, tracking_uri):
    snippets = readme_python_snippets()
    assert len(snippets) >= 2 and any("load_model" in s for s in snippets) and any("history" in s for s in snippets)
    _a_checkout(tmp_path)  # the store the autouse fixture made is this checkout's mlflow.db
    res = CliRunner().invoke(cli, ["replay-history", "--world", tiny_world, "--steps-scale", "0.005",
                                   "--only", "kl05-s800"], catch_exceptions=False)  # a run and version 1
    assert res.exit_code == 0, res.output
    elsewhere = tmp_path_factory.mktemp("elsewhere")  # outside the checkout
    inside = tmp_path / "notebooks"
    inside.mkdir()
    for cwd, uri in ((elsewhere, tracking_uri), (inside, None)):
        for snippet in snippets:
            out = _fresh(snippet, cwd, uri)
            assert out.returncode == 0 and out.stderr == "", (cwd, snippet, out.stderr[-3000:])
            assert out.stdout.strip(), snippet
            if "leaderboard" in snippet:
                assert "kl05-s800" in out.stdout
            if "load_model" in snippet:
                assert "logprob" in out.stdout and "dune" in out.stdout
        assert os.listdir(cwd) == [], cwd  # no empty ./mlflow.db, no ./mlruns


def test_the_default_experiment_plugin_loads_when_this_project_is_imported_before_mlflow(tmp_path, tracking_uri):
    _a_checkout(tmp_path)
    (tmp_path / "notebooks").mkdir()
    code = ("from rlhf_mlflow.tracking import history  # this project first, as the README's snippet\n"
            "import mlflow\n"
            "with mlflow.start_run() as run:\n"
            "    pass\n"
            "print(mlflow.get_experiment(run.info.experiment_id).name)\n")
    out = _fresh(code, tmp_path / "notebooks", tracking_uri)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "circular import" not in out.stderr and "Warning" not in out.stderr, out.stderr
    assert out.stdout.split() == ["rlhf_mlflow"]  # the provider is registered: the checkout's experiment
