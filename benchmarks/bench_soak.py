"""Soak test of a long run: does anything per step grow with the step count? And does a kill -9 at
a random step, then a re-run, end where an uninterrupted run ends?

    python benchmarks/bench_soak.py [--steps 2000] [--batch 2] [--checkpoint-every 100]
        [--kill-step K | --no-kill] [--seed 0] [--out-dir results/bench/soak]
    python benchmarks/bench_soak.py --analyze [--out-dir ...]    # re-describe an earlier run's data

The tiny preset (`bench_costmodel.PRESETS`) on the demo data, trained by `dflop.runtime.run.train`
on 2 ranks under torchrun (gloo: vision tower on rank 0, the LLM on rank 1, 2 microbatches), with a
small global batch so that steps are short and many. Three runs:

1. ``full``: uninterrupted. Every rank timestamps the top of each step and reads its resident set
   size there (`Probe`); rank 0's host overhead outside step k is the time from step k's start to
   step k+1's, less step k's ``step_s`` (metrics.parquet): the metrics row, the scheduler's report,
   the log line, the gather of stage times and, every ``--checkpoint-every`` steps, the checkpoint.
2. ``killed``: the same run, its whole process group sent SIGKILL once rank 0 has logged step K
   (random in (checkpoint_every, steps), `--seed`; or `--kill-step`).
3. the same command again in ``killed``'s folder: it resumes from the last checkpoint.

Prints, for step time, rank 0's overhead and each rank's RSS, the slope against the step count
(Theil-Sen, per 1,000 steps, with its 95 % interval; after the first `WARMUP` steps, and over the
second half alone, once allocations have settled) beside the median level, and the medians of each
quarter of the run (the machine's load drifts: it moves step time and overhead alike), then how far the re-run's final weights and metrics are from the uninterrupted
run's. Writes the per-step data to ``<out-dir>/soak_steps.csv`` and the summary to
``<out-dir>/soak_summary.json`` (both atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_trainer import model_section, prepare  # noqa: E402  (demo data and shapes, made once)

WARMUP = 20  # first steps left out of the slopes: allocator and caches settle
TWO_RANKS = ("vision: {{tp: 1, pp: 1, dp: 1, layers_per_stage: [2]}}\n"
             "llm: {{tp: 1, pp: 1, dp: 1, layers_per_stage: [2]}}\n"
             "placement: disjoint\nmicrobatches: 2\nglobal_batch_size: {batch}\nworld_size: 2\n")
METRIC_COLUMNS = ("step", "loss", "grad_norm", "lr", "samples", "tokens")


# -- inside the torchrun workers -------------------------------------------------------------------


class Probe:
    """Per step, on this rank: the host clock at the step's top and the resident set size there."""

    def __init__(self):
        self.rows: list[tuple[int, float, int]] = []
        self._page = os.sysconf("SC_PAGE_SIZE")

    def __call__(self, step: int) -> None:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * self._page
        self.rows.append((step, time.perf_counter(), rss))

    def save(self, path: Path) -> None:
        import pandas as pd

        from dflop.io import atomic_path

        with atomic_path(path) as tmp:
            pd.DataFrame(self.rows, columns=["step", "start_s", "rss_bytes"]).to_csv(tmp, index=False)


def worker(spec_path: str) -> int:
    """One rank of one run (under torchrun): `train`, with the step probe when the spec asks."""
    import logging

    import torch.distributed as dist

    from dflop.config import Config
    from dflop.runtime.process_group import init_distributed
    from dflop.runtime.run import train
    from dflop.runtime.spans import SpanRecorder

    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("dflop.train").setLevel(logging.INFO)  # "step k/n ...": the parent kills on it
    init_distributed("cpu")
    probe = Probe() if spec["probe"] else None
    if probe is not None:  # SpanRecorder.begin_step is called once at the top of every step
        begin = SpanRecorder.begin_step
        SpanRecorder.begin_step = lambda self, step: (probe(step), begin(self, step))[1]
    train(Config.from_dict(spec["config"]), plan_path=spec["plan"], shapes_path=spec["shapes"],
          costmodel_path=None, out_dir=spec["out"], progress=False)
    if probe is not None:
        probe.save(Path(spec["out"]) / f"probe_rank{dist.get_rank()}.csv")
    dist.destroy_process_group()
    return 0


# -- the parent ------------------------------------------------------------------------------------


def launch(spec: Path, kill_after: int | None = None) -> float:
    """Run the 2-rank job of `spec`; with `kill_after`, SIGKILL its process group once rank 0 has
    logged that step. Returns the wall seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--worker", str(spec)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tail: list[str] = []
    try:
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            if kill_after is not None and line.startswith(f"step {kill_after}/"):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return time.perf_counter() - t0
        if proc.wait() != 0:
            raise SystemExit(f"{spec.parent.name} run failed:\n{''.join(tail)}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if kill_after is not None:
        raise SystemExit(f"the run ended before step {kill_after} was logged:\n{''.join(tail)}")
    return time.perf_counter() - t0


def write_spec(out: Path, name: str, config: dict, plan: Path, shapes: Path, probe: bool) -> Path:
    run_dir = out / name
    spec = out / f"{name}.json"
    spec.write_text(json.dumps({"config": config, "plan": str(plan), "shapes": str(shapes), "out": str(run_dir),
                                "probe": probe}))
    return spec


def per_step(run_dir: Path):
    """rank 0's step time and overhead, every rank's RSS, by step (the last step has no overhead)."""
    import pandas as pd

    metrics = pd.read_parquet(run_dir / "metrics.parquet")[["step", "step_s"]]
    probes = {r: pd.read_csv(run_dir / f"probe_rank{r}.csv") for r in (0, 1)}
    frame = metrics.merge(probes[0], on="step")
    frame["overhead_s"] = frame["start_s"].shift(-1) - frame["start_s"] - frame["step_s"]
    for r, probe in probes.items():
        frame = frame.merge(probe[["step", "rss_bytes"]].rename(columns={"rss_bytes": f"rss_mb_rank{r}"}), on="step")
        frame[f"rss_mb_rank{r}"] /= 2**20
    return frame.drop(columns="start_s")


def slope(steps: np.ndarray, values: np.ndarray) -> dict:
    """Theil-Sen slope per 1,000 steps with its 95 % interval, and the median level."""
    from scipy.stats import theilslopes

    ok = np.isfinite(values)
    fit = theilslopes(values[ok], steps[ok] / 1000.0, alpha=0.95)
    return {"median": float(np.median(values[ok])), "slope_per_1000": float(fit.slope),
            "low": float(fit.low_slope), "high": float(fit.high_slope)}


SERIES = {"step_s": ("ms", 1e3), "overhead_s": ("ms", 1e3), "rss_mb_rank0": ("MB", 1.0), "rss_mb_rank1": ("MB", 1.0)}


def describe(frame, checkpoint_every: int) -> dict:
    """Print and return the slopes (after `WARMUP`, and over the second half alone) and the medians
    of each quarter of the run: machine load that drifts during the run moves the step time and
    the overhead alike, which the quarters show and the slope's interval (independent noise) does not."""
    last = int(frame["step"].max())
    spans = {"steady": frame[frame["step"] > WARMUP], "second_half": frame[frame["step"] > last // 2]}
    out: dict = {"slopes": {}, "quarters": {}}
    for span, rows in spans.items():
        out["slopes"][span] = {c: slope(rows["step"].to_numpy(float), rows[c].to_numpy(float)) for c in SERIES}
    quarter = (frame["step"] - 1) * 4 // last
    for c in SERIES:
        out["quarters"][c] = [float(v) for v in frame.groupby(quarter)[c].median()]
    at_checkpoint = frame[frame["step"] % checkpoint_every == 0]["overhead_s"]
    out["overhead_at_checkpoint_median_s"] = float(at_checkpoint.median())

    for span, first in (("steady", WARMUP + 1), ("second_half", last // 2 + 1)):
        print(f"slopes over steps {first}-{last} (Theil-Sen, per 1,000 steps, 95 % interval):")
        for c, (unit, scale) in SERIES.items():
            s = out["slopes"][span][c]
            print(f"  {c:13s} median {s['median'] * scale:9.2f} {unit}  slope {s['slope_per_1000'] * scale:+8.3f} "
                  f"{unit} [{s['low'] * scale:+.3f}, {s['high'] * scale:+.3f}]")
    print("medians of each quarter of the run:")
    for c, (unit, scale) in SERIES.items():
        print(f"  {c:13s} " + "  ".join(f"{v * scale:9.2f}" for v in out["quarters"][c]) + f" {unit}")
    print(f"rank 0's overhead after a checkpoint's step (median): {out['overhead_at_checkpoint_median_s'] * 1e3:.0f} ms")
    return out


def compare(full: Path, resumed: Path) -> dict:
    """How far the re-run's final weights and metrics are from the uninterrupted run's."""
    import pandas as pd
    from safetensors.torch import load_file

    a, b = load_file(full / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    weights = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    ma = pd.read_parquet(full / "metrics.parquet")[list(METRIC_COLUMNS)]
    mb = pd.read_parquet(resumed / "metrics.parquet")[list(METRIC_COLUMNS)]
    same_steps = ma["step"].tolist() == mb["step"].tolist()
    diffs = {c: float((ma[c] - mb[c]).abs().max()) for c in METRIC_COLUMNS[1:]} if same_steps else {}
    return {"same_steps": same_steps, "steps": len(mb), "weights_max_abs_diff": weights, "metrics_max_abs_diff": diffs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=2, help="global batch (samples per step)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--kill-step", type=int, help="the step after which the killed run is killed (default: random)")
    p.add_argument("--no-kill", action="store_true", help="only the uninterrupted run")
    p.add_argument("--seed", type=int, default=0, help="picks the kill step")
    p.add_argument("--out-dir", type=Path, default=ROOT / "results" / "bench" / "soak")
    p.add_argument("--analyze", action="store_true",
                   help="only re-describe <out-dir>/soak_steps.csv of an earlier run (updates soak_summary.json)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)

    from dflop.io import atomic_path, write_text_atomic

    out = args.out_dir.resolve()
    if args.analyze:
        import pandas as pd

        summary = json.loads((out / "soak_summary.json").read_text())
        summary.update(describe(pd.read_csv(out / "soak_steps.csv"), summary["checkpoint_every"]))
        write_text_atomic(out / "soak_summary.json", json.dumps(summary, indent=2))
        return 0
    manifest, shapes, _ = prepare(out.parent / "trainer", 300, "tiny", None, analytic=True)
    plan = out / "plan.yaml"
    plan.parent.mkdir(parents=True, exist_ok=True)
    plan.write_text(TWO_RANKS.format(batch=args.batch))
    config = {"model": model_section("tiny"), "data": {"datasets": [{"name": "demo", "path": str(manifest)}]},
              "train": {"global_batch_size": args.batch, "steps": args.steps, "checkpoint_every": args.checkpoint_every,
                        "warmup_steps": 10, "lr": 1e-3}}
    for name in ("full", "killed"):
        shutil.rmtree(out / name, ignore_errors=True)  # a re-run of the benchmark starts afresh

    wall = {"full": launch(write_spec(out, "full", config, plan, shapes, probe=True))}
    frame = per_step(out / "full")
    with atomic_path(out / "soak_steps.csv") as tmp:
        frame.to_csv(tmp, index=False)
    print(f"uninterrupted run: {args.steps} steps in {wall['full']:.0f} s")
    summary = {"steps": args.steps, "batch": args.batch, "checkpoint_every": args.checkpoint_every,
               **describe(frame, args.checkpoint_every)}

    if not args.no_kill:
        kill = args.kill_step or random.Random(args.seed).randrange(args.checkpoint_every + 1, args.steps)
        spec = write_spec(out, "killed", config, plan, shapes, probe=False)
        wall["killed"] = launch(spec, kill_after=kill)
        wall["rerun"] = launch(spec)
        summary["kill"] = {"after_step": kill, **compare(out / "full", out / "killed")}
        k = summary["kill"]
        print(f"kill -9 after step {kill} logged, re-run ({wall['killed']:.0f} s + {wall['rerun']:.0f} s): "
              f"steps 1-{k['steps']} each once: {k['same_steps']}; final weights max |diff| "
              f"{k['weights_max_abs_diff']:.3g}; metrics max |diff| "
              + ", ".join(f"{c} {v:.3g}" for c, v in k["metrics_max_abs_diff"].items()))
    summary["wall_s"] = wall
    write_text_atomic(out / "soak_summary.json", json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
