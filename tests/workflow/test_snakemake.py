"""The Snakemake workflow: lint, what the data and model stages of a real run wrote, and exact re-run
triggers (dry runs on a copy of the session's demo run)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
pytestmark = pytest.mark.slow


def _env():
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the rules call `dflop`
    return env


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [*SNAKEMAKE, "--snakefile", str(REPO / "workflow/Snakefile"), "--directory", str(workdir),
           "--profile", str(REPO / "profiles/local"), "--cores", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=workdir)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def planned_rules(workdir: Path, *args: str) -> set[str]:
    """Rules a dry run would execute (their names, from the job table)."""
    out = snakemake(workdir, "--dry-run", *args).stdout
    names, in_table = set(), False
    for line in out.splitlines():
        if line.startswith("job ") and "count" in line:
            in_table = True
            continue
        if in_table:
            if line.startswith("total"):
                break
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                names.add(parts[0])
    return names - {"all"}


@pytest.fixture(scope="module")
def workdir(demo_workdir, tmp_path_factory):
    """A copy of the session's demo run (`demo_workdir`: the small demo config, every stage run once),
    so these tests cost no chain of their own; they change files and configs only in this copy."""
    root = tmp_path_factory.mktemp("wf") / "demo"
    shutil.copytree(demo_workdir, root)  # copy2: modification times are kept, nothing looks newer
    return root


def _n_samples(workdir: Path) -> int:
    return yaml.safe_load((workdir / "config/config.yaml").read_text())["data"]["demo"]["n_samples"]


def test_lint_is_clean():
    proc = subprocess.run([*SNAKEMAKE, "--lint", "--snakefile", str(REPO / "workflow/Snakefile")],
                          capture_output=True, text=True, cwd=REPO, env=_env())
    assert "Congratulations, your workflow is in a good condition!" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_profile_data_writes_both_parquet_files(workdir):
    n = _n_samples(workdir)
    shapes = pd.read_parquet(workdir / "results/data/shapes.parquet")
    assert len(shapes) == n and (shapes["status"] == "ok").all()
    assert len(pd.read_parquet(workdir / "results/data/histograms.parquet")) > 0
    assert (workdir / "logs/profile_data.log").read_text().count(f"profiled {n} samples") == 1
    assert planned_rules(workdir, "profile_data", "fit") == set()  # up to date


def test_model_stages_write_profile_and_cost_model(workdir):
    profile = pd.read_parquet(workdir / "results/profile/model_profile.parquet")
    assert {"vision_layer", "llm_layer", "llm_head"} <= set(profile["module"])
    assert (workdir / "results/costmodel/costmodel.json").exists()
    loading = json.loads((workdir / "results/costmodel/costmodel.json").read_text())["step_costs"]["loading"]
    assert loading["n_samples"] == len(pd.read_parquet(workdir / "results/profile/load_profile.parquet"))
    assert len(pd.read_parquet(workdir / "results/costmodel/validation.parquet")) > 0


def test_touching_a_dataset_reruns_the_data_stages_not_the_model_profiler(workdir):
    manifest = workdir / "results/demo/demo.json"
    before = manifest.stat()
    time.sleep(1.1)  # mtime resolution
    manifest.touch()
    try:  # the load line (profile_loading, into the cost model) is timed on the data
        assert planned_rules(workdir, "profile_data", "fit") == {"profile_data", "profile_loading", "fit"}
    finally:
        os.utime(manifest, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_editing_a_dataset_reruns_profile_data_only(workdir):
    manifest = workdir / "results/demo/demo.json"
    original, before = manifest.read_bytes(), manifest.stat()
    time.sleep(1.1)
    try:
        manifest.write_bytes(original + b"\n")
        # Without the profile's mtime rule too: a real content change is always a change.
        out = subprocess.run([*SNAKEMAKE, "--snakefile", str(REPO / "workflow/Snakefile"), "--directory", str(workdir),
                              "--cores", "2", "--dry-run", "profile_data"], capture_output=True, text=True, env=_env())
        assert "profile_data" in out.stdout and "make_demo_data" not in out.stdout, out.stdout
    finally:
        manifest.write_bytes(original)
        os.utime(manifest, ns=(before.st_atime_ns, before.st_mtime_ns))


def _with_config(workdir: Path, name: str, change) -> str:
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    change(config)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_model_change_reruns_model_stages_not_data(workdir):
    llm = _with_config(workdir, "llm", lambda c: c["model"].update(llm="llama3-tiny"))
    # the LLM's vocabulary is part of how the loader tokenises: the load line is re-timed
    assert planned_rules(workdir, "profile_data", "fit", "--configfile", llm) == {"profile_model", "profile_loading", "fit"}
    prof = _with_config(workdir, "prof", lambda c: c["profile"].update(repeats=3))
    assert planned_rules(workdir, "profile_data", "fit", "--configfile", prof) == {"profile_model", "fit"}


def test_changing_a_param_reruns_only_rules_that_use_it(workdir):
    skip = _with_config(workdir, "skip", lambda c: c["data"].update(max_skip_frac=0.5))
    assert planned_rules(workdir, "profile_data", "fit", "--configfile", skip) == {"profile_data", "profile_loading", "fit"}
    loads = _with_config(workdir, "loads", lambda c: c["data"].update(load_profile_samples=5))
    assert planned_rules(workdir, "profile_data", "fit", "--configfile", loads) == {"profile_loading", "fit"}
    demo = _with_config(workdir, "demo", lambda c: c["data"]["demo"].update(n_samples=_n_samples(workdir) + 1))
    assert planned_rules(workdir, "profile_data", "--configfile", demo) == {"make_demo_data", "profile_data"}
    # A value only the model profiler uses leaves the data stages alone, and vice versa.
    unrelated = _with_config(workdir, "unrelated", lambda c: c["profile"].update(repeats=9))
    assert "profile_data" not in planned_rules(workdir, "profile_data", "--configfile", unrelated)


def test_dataset_weights_replan_and_retrain_without_reprofiling(workdir):
    """The mix (data.datasets[].weight) decides which samples train, not any sample's shape: the
    plan and the training follow it, the data stages and the load profile do not."""
    weighted = _with_config(workdir, "weighted", lambda c: c["data"]["datasets"][0].update(weight=2.0))
    ran = planned_rules(workdir, "train", "--configfile", weighted)
    assert {"optimize", "train"} <= ran and not ran & {"make_demo_data", "profile_data", "profile_loading"}, ran


def test_a_changed_value_is_a_short_reason_naming_its_section(workdir):
    """The reason Snakemake prints compares per-section digests, not two copies of the settings."""
    skip = _with_config(workdir, "skip_reason", lambda c: c["data"].update(max_skip_frac=0.25))
    out = snakemake(workdir, "--dry-run", "profile_data", "--configfile", skip).stdout
    (reason,) = [line for line in out.splitlines() if "Params have changed" in line]
    assert len(reason) < 300 and "max_skip_frac" not in reason, reason
    before, now = (dict(item.split(":") for item in part.split("'")[1].split())
                   for part in reason.split("before:")[1].split("now:"))
    assert set(before) == set(now) == {"run", "model", "data"}  # the sections profile_data reads
    assert [name for name in before if before[name] != now[name]] == ["data"]


def test_bad_config_is_one_line_naming_key(workdir):
    bad = _with_config(workdir, "bad", lambda c: c["data"].update(max_skip_frac=2))
    proc = snakemake(workdir, "--dry-run", "profile_data", "--configfile", bad, check=False)
    assert proc.returncode != 0
    assert "config error: data.max_skip_frac: 2 is greater than the maximum of 1 (rule: maximum)" in proc.stderr + proc.stdout
