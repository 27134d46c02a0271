"""`snakemake --report report.html` after a demo run (`all`): every plot is in the report, byte for
byte, with its caption and category."""

import base64
import json
import shutil

import pytest

from workflow_run import REPO, run_snakemake

pytestmark = pytest.mark.slow

PLOTS = {  # report PNG -> (rule, category)
    "results/report/summary.png": ("plot_summary", "0. Summary"),
    "results/report/data_shapes.png": ("plot_data", "1. Data"),
    "results/report/costmodel_fit.png": ("plot_costmodel", "2. Cost model"),
    "results/report/plan_vs_baseline.png": ("plot_plan", "3. Plan"),
    "results/report/gantt_plan.png": ("plot_plan", "3. Plan"),
    "results/report/gantt_baseline.png": ("plot_plan", "3. Plan"),
    "results/report/candidates.png": ("plot_candidates", "3. Plan"),
}
TRAINING_PLOT = {"results/report/training_curves.png": ("plot_training", "4. Training"),
                 "results/report/timeline.png": ("plot_timeline", "4. Training")}


def _js_object(html: str, name: str) -> dict:
    """The JSON object assigned to `var name = {...};` in the report page."""
    marker = f"var {name} = "
    start = html.rindex(marker) + len(marker)  # the last one: vendored scripts come first
    obj, _ = json.JSONDecoder().raw_decode(html, start)
    return obj


def test_report_holds_every_plot(demo_workdir, tmp_path):
    workdir = tmp_path / "demo"
    shutil.copytree(demo_workdir, workdir)
    plots = dict(PLOTS)
    if (REPO / "workflow/rules/train.smk").exists():
        plots.update(TRAINING_PLOT)
    run_snakemake(workdir, "--report", "report.html")  # what the README tells users to run
    html = (workdir / "report.html").read_text()
    results, categories = _js_object(html, "results"), _js_object(html, "categories")
    for path, (rule, category) in plots.items():
        assert path in results, f"{path} not in the report; it has {sorted(results)}"
        entry = results[path]
        assert entry["job_properties"]["rule"] == rule
        assert entry["mime_type"] == "image/png"
        assert entry["caption"].strip(), f"{path} has no caption"
        header, payload = entry["data_uri"].split("base64,", 1)
        assert header.startswith("data:image/png")
        assert base64.b64decode(payload) == (workdir / path).read_bytes()  # the plot itself, not a stale copy
        assert any(path in files for files in categories[category].values())
    assert set(results) == set(plots)
    # The front page (workflow.rst) shows the summary card (by its path, next to report.html) and links it.
    assert 'src=\\"results/report/summary.png\\"' in html
    assert "showResultInfo" in html[html.index("DFLOP: data-aware"):]
