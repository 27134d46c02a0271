"""How steady this machine's speed is over windows of a few seconds to a minute.

    python benchmarks/bench_machine_phases.py [--seconds 240] [--processes 2]

Each of `--processes` processes (one torch thread each, like a CPU training rank) times a fixed
piece of work (20 products of two 256 x 256 float32 matrices, ~5 ms) back to back for `--seconds`.
For windows of 3, 5, 10, 20 and 60 s it prints the spread of the window's mean time against the
whole run's mean: how far a measurement that lasts that long (a profile, the demo's steps 3-12)
can land from the machine's long-run speed through no fault of what it measures. Issue 21's
+-10 % on a prediction made from one window and checked in another needs both windows long
enough for that spread to be small.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

WINDOWS_S = (3, 5, 10, 20, 60)


def work_times(seconds: float, queue) -> None:
    """Time the fixed work back to back for `seconds`; put (start times, durations) on `queue`."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(20):  # warm-up
        a @ b
    starts, durations = [], []
    end = time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        for _ in range(20):
            a @ b
        starts.append(now)
        durations.append(time.perf_counter() - now)
    queue.put((np.array(starts), np.array(durations)))


def window_spread(starts: np.ndarray, durations: np.ndarray, window_s: float) -> np.ndarray:
    """Mean duration in each window of `window_s` (windows overlapping by half), over the run's mean."""
    t = starts - starts[0]
    lows = np.arange(0.0, t[-1] - window_s + 1e-9, window_s / 2)
    means = np.array([durations[(t >= lo) & (t < lo + window_s)].mean() for lo in lows])
    return means / durations.mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=work_times, args=(args.seconds, queue)) for _ in range(args.processes)]
    for w in workers:
        w.start()
    runs = [queue.get(timeout=args.seconds + 120) for _ in workers]  # a worker that died: an error, not a hang
    for w in workers:
        w.join()
    for k, (starts, durations) in enumerate(runs):
        print(f"process {k}: {len(durations)} timings, median {1e3 * np.median(durations):.2f} ms, "
              f"mean / median {durations.mean() / np.median(durations):.3f}")
        for window in WINDOWS_S:
            if window * 2 > args.seconds:
                continue
            r = window_spread(starts, durations, window)
            print(f"  {window:>3} s windows ({len(r)}): window mean / run mean p10 {np.quantile(r, 0.1):.3f}, "
                  f"p50 {np.median(r):.3f}, p90 {np.quantile(r, 0.9):.3f}, min {r.min():.3f}, max {r.max():.3f}")


if __name__ == "__main__":
    main()
