"""The MLflow UI a newcomer opens after `make run`: Debian's Chromium, headless, on a real `mlflow
server --app-name rlhf` over the store of a small `main` on the test-scale world (the `story`
fixture, conftest.py). Asserts on the rendered DOM; the screenshots are kept beside it (and copied to
$RLHF_UI_SHOTS when set, which is how docs/ui-*.png are made)."""
from __future__ import annotations

import html
import math
import os
import re
import shutil
import subprocess

import mlflow
import pytest
from conftest import rlhf_ui_server

from rlhf_mlflow.decisions.guardrails import NAMES as GUARDRAILS
from rlhf_mlflow.tracking import experiment_view as EV

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHART_BOUND = 1e6


def _chromium(args: list[str], profile: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}",
                           "--window-size=1600,1100", "--virtual-time-budget=15000", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def ui(story, tmp_path):
    """`mlflow server --app-name rlhf` on the story's store, on a free loopback port, until the test ends."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium; `make test` leaves these slow tests out)")
    with rlhf_ui_server(mlflow.get_tracking_uri(), tmp_path) as url:
        yield url


def _page(url: str, shot, fresh: str) -> str:
    """The rendered page's DOM in a browser that never saw this UI (profile `fresh`), and its screenshot
    (two runs: one that does both hangs)."""
    _chromium([f"--screenshot={shot}", url], f"{fresh}-shot")
    dom = _chromium(["--dump-dom", url], f"{fresh}-dom").stdout
    if os.environ.get("RLHF_UI_SHOTS"):
        shutil.copy(shot, os.path.join(os.environ["RLHF_UI_SHOTS"], os.path.basename(shot)))
    return html.unescape(dom)


def _main_run():
    (main,) = [r for r in mlflow.search_runs(search_all_experiments=True, output_format="list")
               if r.data.tags.get("rlhf.step") == "main"]
    return main


@pytest.mark.slow
def test_the_experiment_opens_on_its_runs_with_the_champion_on_top(ui, tmp_path):
    main = _main_run()
    exp = main.info.experiment_id
    champion = mlflow.MlflowClient().get_model_version_by_alias("rlhf-policy", "champion")
    page = _page(f"{ui}/#/experiments/{exp}", tmp_path / "ui-experiment.png", str(tmp_path / "p1"))
    assert "Detect Issues" not in page and "Evaluation runs" not in page  # not the GenAI overview
    assert ">main<" in page  # the runs table, main at the top level
    first = mlflow.get_experiment(exp).tags[EV.NOTE_TAG].splitlines()[0]
    assert first.startswith(f"Champion: v{champion.version} ") and first in page  # the description, above the runs
    view = _page(f"{ui}/{EV.view_link(exp)}", tmp_path / "ui-candidates.png", str(tmp_path / "p2"))
    for column in (EV.VERDICT, EV.CERTIFIED, EV.TRUTH):
        assert column in view  # the candidates view's columns


@pytest.mark.slow
def test_the_registry_shows_the_champion_and_each_refusal_without_expanding(ui, tmp_path):
    client = mlflow.MlflowClient()
    versions = client.search_model_versions("name = 'rlhf-policy'")
    refused = [v for v in versions if v.tags["release.decision"] == "refused"]
    assert refused, "the story needs refused versions"
    page = _page(f"{ui}/#/models/rlhf-policy", tmp_path / "ui-registry.png", str(tmp_path / "p3"))
    assert "@champion" in page or "@ champion" in page
    for v in refused:  # the verdict opens the Description column; each failing guardrail is a tag shown whole
        assert f"REFUSED v{v.version}" in page
        failed = {k: val for k, val in v.tags.items() if k.startswith("failed.")}
        assert failed, v.tags
        for key, value in failed.items():
            assert re.search(re.escape(f">{key}<") + ".{0,400}?" + re.escape(value), page), (key, value)
    version = _page(f"{ui}/#/models/rlhf-policy/versions/{refused[0].version}",
                    tmp_path / f"ui-version-{refused[0].version}.png", str(tmp_path / "p4"))
    assert "Failed:" in version and any(f"<strong>{g}</strong>:" in version for g in GUARDRAILS)  # rendered, in full
    main = _main_run()
    page = _page(f"{ui}/#/experiments/{main.info.experiment_id}/runs/{main.info.run_id}", tmp_path / "ui-main.png",
                 str(tmp_path / "p5"))
    champion = client.get_model_version_by_alias("rlhf-policy", "champion")
    assert f"Champion: version {champion.version}" in page  # main's summary on its run page
    for shot in ("ui-registry.png", "ui-main.png"):
        assert (tmp_path / shot).stat().st_size > 10_000  # a rendered page, not a blank one


@pytest.mark.slow
def test_no_chart_shows_an_absurd_value_and_a_certify_run_few_metrics(story):
    client = mlflow.MlflowClient()
    for run in mlflow.search_runs(search_all_experiments=True, output_format="list"):
        for key in run.data.metrics:
            for m in client.get_metric_history(run.info.run_id, key):
                assert math.isfinite(m.value) and abs(m.value) <= CHART_BOUND, (run.info.run_name, key, m.value)
        if run.data.tags.get("rlhf.step") == "certify":
            assert len(run.data.metrics) <= 8, (run.info.run_name, sorted(run.data.metrics))
