"""`snakemake --report report.html` after a demo run (`all`): every plot is in the report, byte for
byte, with its caption and category."""

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
pytestmark = pytest.mark.slow

PLOTS = {  # report PNG -> (rule, category)
    "results/report/data_shapes.png": ("plot_data", "1. Data"),
    "results/report/costmodel_fit.png": ("plot_costmodel", "2. Cost model"),
    "results/report/plan_vs_baseline.png": ("plot_plan", "3. Plan"),
    "results/report/gantt_plan.png": ("plot_plan", "3. Plan"),
    "results/report/gantt_baseline.png": ("plot_plan", "3. Plan"),
}
TRAINING_PLOT = {"results/report/training_curves.png": ("plot_training", "4. Training")}


def _env():
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the rules call dflop / python from the env
    return env


def _run(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*SNAKEMAKE, *args], cwd=workdir, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def working_copy(root: Path) -> Path:
    """A user's checkout: workflow/, config/ (a smaller demo), environment.yml."""
    for name in ("workflow", "config"):
        shutil.copytree(REPO / name, root / name)
    shutil.copy(REPO / "environment.yml", root / "environment.yml")
    config = yaml.safe_load((root / "config/config.yaml").read_text())
    config["data"]["demo"]["n_samples"] = 60
    config["profile"] = {"repeats": 2, "warmup": 1, "max_seq_len": 256, "max_tiles": 8, "time_budget_s": 10}
    config.setdefault("train", {}).update(steps=2, checkpoint_every=2)
    (root / "config/config.yaml").write_text(yaml.safe_dump(config))
    return root


def _js_object(html: str, name: str) -> dict:
    """The JSON object assigned to `var name = {...};` in the report page."""
    marker = f"var {name} = "
    start = html.rindex(marker) + len(marker)  # the last one: vendored scripts come first
    obj, _ = json.JSONDecoder().raw_decode(html, start)
    return obj


def test_report_holds_every_plot(tmp_path):
    workdir = working_copy(tmp_path)
    _run(workdir, "--profile", str(REPO / "profiles/local"), "--cores", "2", "all")  # the demo run
    plots = dict(PLOTS)
    if (REPO / "workflow/rules/train.smk").exists():
        plots.update(TRAINING_PLOT)
    _run(workdir, "--report", "report.html")  # what the README tells users to run
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
