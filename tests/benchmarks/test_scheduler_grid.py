import pandas as pd
import pytest

from dflop.errors import UserError

from scheduler_grid import bench_scheduler

from dflop.shapes import read_shapes
from synthetic_mix import llava_ov_mix


def test_bench_scheduler_on_a_shapes_file(tmp_path, capsys):
    shapes = llava_ov_mix(300, seed=1, dataset="demo")
    shapes.loc[0, "status"] = "skipped:corrupt"
    path = tmp_path / "shapes.parquet"
    shapes.to_parquet(path)
    summary = bench_scheduler(str(path), str(tmp_path / "bench.csv"), grid=((64, 4, 2), (128, 8, 1)),
                              batches=2, budget_s=0.05, include_mix=False)
    assert list(summary.dataset.unique()) == ["demo"]
    assert {"dflop", "megatron", "llava_group", "lpt1d", "p50_ms", "p99_ms", "vs_best_baseline"} <= set(summary)
    assert (summary.vs_best_baseline <= 1 + 1e-9).all()  # the portfolio never loses to a baseline
    raw = pd.read_csv(tmp_path / "bench.csv")
    assert len(raw) == 2 * 2 * 4 and (tmp_path / "bench_summary.csv").exists()
    assert (raw.bound_s > 0).all() and (raw.step_s > 0).all()
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert "llava_group" in header
    legend = out[out.index("columns ("):]
    assert all(column in legend for column in header)  # every printed column is explained


def test_read_shapes_errors(tmp_path):
    with pytest.raises(UserError, match=r"missing\.parquet: no such file \(no shapes file"):
        read_shapes(tmp_path / "missing.parquet")
    llava_ov_mix(3).assign(status="skipped:x").to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(UserError, match="no sample with status 'ok'"):
        read_shapes(tmp_path / "bad.parquet")


def test_bench_scheduler_script(tmp_path, capsys):
    from bench_scheduler import main

    llava_ov_mix(200, seed=2, dataset="cli").to_parquet(tmp_path / "shapes.parquet")
    code = main(["--shapes", str(tmp_path / "shapes.parquet"), "--no-mix", "--grid", "64:4:1",
                 "--batches", "1", "--out", str(tmp_path / "b.csv")])
    assert code == 0
    raw = pd.read_csv(tmp_path / "b.csv")
    assert set(raw.policy) == {"dflop", "megatron", "llava_group", "lpt1d"} and set(raw.dataset) == {"cli"}
    assert "vs_best_baseline" in capsys.readouterr().out


def test_bench_scheduler_bad_grid_is_one_line(capsys):
    from bench_scheduler import main

    assert main(["--grid", "64:4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'64:4' is not n:m:dp" in err
