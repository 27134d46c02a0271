"""Throughput of the data profiler on a large manifest of real image files.

Generates a 50k-sample LLaVA manifest over real JPEG/PNG files (dflop.data.demo.make_image_manifest),
then runs the data profiler with 1 worker and with all cores, and, as the baseline, a profiler
that decodes every image (what a pipeline that runs the image processor to learn shapes pays) on
a subsample. Prints samples/s of each and the ratio, measured in this one run.

    python benchmarks/bench_profile_data.py [--samples 50000] [--distinct-images 2000] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from PIL import Image

from dflop.config import Config
from dflop.data.demo import make_image_manifest
from dflop.data.readers import read_dataset
from dflop.profiling.data_profiler import profile_data


def decode_baseline(manifest: Path, limit: int) -> float:
    """Samples/s of learning image sizes by decoding pixels (PIL full decode to RGB)."""
    start, n = time.perf_counter(), 0
    for sample in read_dataset(manifest, sample=f"first:{limit}"):
        for ref in sample.images:
            with Image.open(ref.path) as im:
                im.convert("RGB").size
        n += 1
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--distinct-images", type=int, default=2000)
    parser.add_argument("--baseline-samples", type=int, default=2000)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dflop-bench-data-"))
    t0 = time.perf_counter()
    manifest = make_image_manifest(workdir, n_samples=args.samples, n_distinct_images=args.distinct_images)
    print(f"manifest: {manifest} ({args.samples} samples over {args.distinct_images} image files, "
          f"{time.perf_counter() - t0:.1f} s to generate)")

    cfg = Config.from_dict({"data": {"datasets": [{"name": "bench", "path": str(manifest)}]}})
    cores = os.cpu_count() or 1
    results = {}
    for workers in sorted({1, cores}):
        start = time.perf_counter()
        profile_data(cfg, shapes_path=workdir / f"shapes_w{workers}.parquet",
                     histograms_path=workdir / f"hist_w{workers}.parquet", workers=workers, progress=False)
        results[workers] = args.samples / (time.perf_counter() - start)
    baseline = decode_baseline(manifest, args.baseline_samples)

    print()
    print(f"{'method':<42} {'samples/s':>10} {'vs decode':>10}")
    print(f"{'decode pixels (baseline, 1 process)':<42} {baseline:>10.0f} {1.0:>9.1f}x")
    for workers, rate in results.items():
        label = f"dflop profile-data, {workers} worker{'s' if workers > 1 else ''} (end to end)"
        print(f"{label:<42} {rate:>10.0f} {rate / baseline:>9.1f}x")
    print(f"\nmachine: {cores} cores; 1M samples at {max(results.values()):.0f}/s take "
          f"{1e6 / max(results.values()) / 60:.1f} min")


if __name__ == "__main__":
    main()
