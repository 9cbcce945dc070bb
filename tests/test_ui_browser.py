"""The MLflow UI a newcomer opens after `make run`: Debian's Chromium, headless, on a real `mlflow
server --app-name rlhf` over the store of a small `main` on the test-scale world (the `story`
fixture, conftest.py). Asserts on the rendered DOM of a browser that never saw this UI, with no click;
the screenshots are kept beside it. docs/ui-*.png are made by scripts/screenshots.py (tested here)."""
from __future__ import annotations

import html
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys

import mlflow
import pytest
from conftest import rlhf_ui_server

from rlhf_mlflow.decisions.guardrails import NAMES as GUARDRAILS
from rlhf_mlflow.tracking import experiment_view as EV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHART_BOUND = 1e6
_spec = importlib.util.spec_from_file_location("screenshots", os.path.join(ROOT, "scripts", "screenshots.py"))
screenshots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(screenshots)


def _skip_without_chromium():
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium; `make test` leaves these slow tests out)")


@pytest.fixture
def ui(story, tmp_path):
    """`mlflow server --app-name rlhf` on the story's store, on a free loopback port, until the test ends."""
    _skip_without_chromium()
    with rlhf_ui_server(mlflow.get_tracking_uri(), tmp_path) as url:
        yield url


def _page(url: str, shot) -> str:
    """The rendered page's DOM in a browser that never saw this UI (a fresh profile), and its screenshot
    (two runs: one that does both hangs)."""
    screenshots.shoot(url, str(shot))
    return html.unescape(screenshots.chromium(["--dump-dom", url]).stdout)


def _main_run():
    (main,) = [r for r in mlflow.search_runs(search_all_experiments=True, output_format="list")
               if r.data.tags.get("rlhf.step") == "main"]
    return main


def _first_paragraph(page: str) -> str:
    """The description's first paragraph as rendered: the one line the experiment page shows above its
    fold (MLflow 3.17 clamps the description to it until its arrow is clicked)."""
    match = re.search(r"<p>((?:Champion|No champion)[^\n]*?)</p>", page)
    assert match, "no champion line in the page"
    return match.group(1)


def _rows(page: str) -> dict[str, str]:
    """{run id: nesting level} of every row the runs table rendered (ag-grid's `row-id`, `ag-row-level-N`)."""
    return {rid: level for level, rid in re.findall(r'<div class="[^"]*ag-row-level-(\d+)[^"]*"[^>]*row-id="([^"]+)"',
                                                  page)}


def _cells(page: str, column: str) -> list[tuple[int, str]]:
    """(width in px, text) of each rendered cell of `column` (a column id: `tags.\`key\``)."""
    return [(int(w), t) for w, t in re.findall(re.escape(f'col-id="{column}"') + r'[^>]*style="[^"]*width: (\d+)px;?"'
                                               r'[^>]*>\s*<div[^>]*>\s*<span[^>]*>([^<]*)</span>', page)]


@pytest.mark.slow
def test_the_experiment_opens_on_its_runs_with_the_champion_and_why_not_the_others_on_top(ui, tmp_path):
    main = _main_run()
    exp = main.info.experiment_id
    champion = mlflow.MlflowClient().get_model_version_by_alias("rlhf-policy", "champion")
    page = _page(f"{ui}/#/experiments/{exp}", tmp_path / "ui-experiment.png")
    assert "Detect Issues" not in page and "Evaluation runs" not in page  # not the GenAI overview
    assert ">main<" in page  # the runs table, main at the top level
    first = _first_paragraph(page)
    note = mlflow.get_experiment(exp).tags[EV.NOTE_TAG].splitlines()[0]
    assert re.sub(r"<[^>]+>", "", first) == re.sub(r"\[([^]]+)\]\([^)]+\)", r"\1", note)  # rendered whole
    assert first.startswith(f"Champion: v{champion.version} ") and f'href="{EV.view_link(exp)}"' in first
    refused = [v for v in mlflow.MlflowClient().search_model_versions("name = 'rlhf-policy'")
               if v.tags["release.decision"] == "refused"]
    assert refused, "the story needs refused versions"
    why = first.split("refused: ", 1)[1]
    for v in refused:  # each with the first guardrail it failed, without unfolding the description
        assert re.search(rf"\bv{v.version}\b", why), (v.version, why)
    assert "not certifiable" in why or "beats_champion" in why


@pytest.mark.slow
def test_the_candidates_view_lists_every_candidate_and_its_verdict_as_a_row_of_its_own(ui, tmp_path):
    """The link on the experiment's first line: every candidate a top-level row (not under `main`), its
    verdict, certified quality and truth in columns wide enough to read them whole."""
    main = _main_run()
    candidates = mlflow.search_runs([main.info.experiment_id], f"tags.`{EV.VERDICT}` LIKE '%'", output_format="list")
    assert len(candidates) >= 5
    view = _page(f"{ui}/{EV.view_link(main.info.experiment_id)}", tmp_path / "ui-candidates.png")
    rows = _rows(view)
    assert main.info.run_id not in rows  # no parent row to unfold
    assert {r.info.run_id: rows.get(r.info.run_id) for r in candidates} == {r.info.run_id: "0" for r in candidates}
    for tag in (EV.VERDICT, EV.CERTIFIED, EV.TRUTH):
        cells = _cells(view, f"tags.`{tag}`")
        assert sorted(t for _, t in cells) == sorted(r.data.tags[tag] for r in candidates), tag
        assert {w for w, _ in cells} == {EV.WIDTHS[f"tags.`{tag}`"]}, tag  # the view's widths, applied
    verdicts = [r.data.tags[EV.VERDICT] for r in candidates]
    assert any(v.startswith("champion v") for v in verdicts) and any(v.startswith("refused v") for v in verdicts)


@pytest.mark.slow
def test_the_screenshots_script_draws_the_three_pages_from_a_store(story, tmp_path):
    """scripts/screenshots.py, as the README runs it (docs/ui-*.png), on the story's store."""
    _skip_without_chromium()
    out = tmp_path / "shots"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "screenshots.py"), "--store",
                          mlflow.get_tracking_uri(), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    names = ["ui-experiment.png", "ui-candidates.png", "ui-registry.png"]
    assert sorted(os.listdir(out)) == sorted(names) and res.stdout.split() == [str(out / n) for n in names]
    for name in names:
        with open(out / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert (out / name).stat().st_size > screenshots.MIN_BYTES
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "screenshots.py"), "--store",
                          f"sqlite:///{tmp_path}/empty.db", "--out", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and res.stderr.strip().splitlines()[-1].startswith("Error: no main run in ")
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_the_registry_shows_the_champion_and_each_refusal_without_expanding(ui, tmp_path):
    client = mlflow.MlflowClient()
    versions = client.search_model_versions("name = 'rlhf-policy'")
    refused = [v for v in versions if v.tags["release.decision"] == "refused"]
    assert refused, "the story needs refused versions"
    page = _page(f"{ui}/#/models/rlhf-policy", tmp_path / "ui-registry.png")
    assert "@champion" in page or "@ champion" in page
    for v in refused:  # the verdict opens the Description column; each failing guardrail is a tag shown whole
        assert f"REFUSED v{v.version}" in page
        failed = {k: val for k, val in v.tags.items() if k.startswith("failed.")}
        assert failed, v.tags
        for key, value in failed.items():
            assert re.search(re.escape(f">{key}<") + ".{0,400}?" + re.escape(value), page), (key, value)
    version = _page(f"{ui}/#/models/rlhf-policy/versions/{refused[0].version}",
                    tmp_path / f"ui-version-{refused[0].version}.png")
    assert "Failed:" in version and any(f"<strong>{g}</strong>:" in version for g in GUARDRAILS)  # rendered, in full
    main = _main_run()
    page = _page(f"{ui}/#/experiments/{main.info.experiment_id}/runs/{main.info.run_id}", tmp_path / "ui-main.png")
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
