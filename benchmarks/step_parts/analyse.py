"""Analyse what `sitecustomize.py` recorded in one `dflop train` run (usage: its docstring).

Prints, over steps 3+ (after the warm-up): (1) per module, the time inside the trainer's forwards
against the cost model's prediction for the same bins, and the thread's CPU share of that time;
(2) per step, the measured step against the plan's prediction, the step priced as the simulator
prices it (max over ranks of its loads + compute), the step as a wait for every rank's loads
would make it (max loads + max compute), and the rest.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np
import pandas as pd

from dflop.costmodel.jsonio import load_cost_model
from dflop.costmodel.model import _set_prediction
from dflop.pricing.pool import Pool
from dflop.shapes import read_shapes

FIRST_STEP = 3
VISION = ("vision_embed", "vision_layer", "projector")
LLM = ("llm_embed", "llm_layer", "llm_head")


def main(parts: str, run: str, costmodel: str, shapes: str, vision_layers: int, llm_layers: int) -> None:
    """vision_layers / llm_layers: the layers of the ranks' stages (the demo's colocated stage: all)."""
    cost = load_cost_model(costmodel)
    layers = {"vision_layer": vision_layers, "llm_layer": llm_layers}

    def predict(name, sizes, target="fwd_ms"):
        return _set_prediction(cost.module(name, 1), target, np.asarray(sizes, float)) if len(sizes) else 0.0

    ops = [dict(json.loads(line), rank=int(f.stem[4:])) for f in sorted(Path(parts).glob("rank*.jsonl"))
           for line in open(f)]
    steady = [r for r in ops if r["step"] >= FIRST_STEP]
    mult = lambda name: layers.get(name, 1)  # noqa: E731
    measured, predicted, cpu = collections.Counter(), collections.Counter(), collections.Counter()
    for r in steady:
        tiles, lens = r["tiles"], r["seq_len"]
        sizes = {**{n: tiles for n in VISION}, **{n: lens for n in LLM}}
        if r["op"] == "F":
            mods = {("projector" if k == "projector_img" else k): v for k, v in r["mods"].items()}
            for name in sizes:
                measured[name] += mods.get(name, 0.0)
                cpu[name] += mods.get("cpu_" + ("projector_img" if name == "projector" else name), 0.0)
                predicted[name] += mult(name) * predict(name, sizes[name]) / 1e3
        measured[r["op"] + " op"] += r["wall"]
        cpu[r["op"] + " op"] += r["mods"].get("cpu_wall", 0.0)
        target = "fwd_ms" if r["op"] == "F" else "bwd_ms"
        predicted[r["op"] + " op"] += sum(mult(n) * predict(n, sizes[n], target) for n in sizes) / 1e3
    per = len({(r["step"], r["rank"]) for r in steady if r["op"] == "F"})
    print(f"{'part':14s} {'measured ms':>12s} {'predicted ms':>13s} {'ratio':>6s} {'cpu/wall':>9s}  (per step and rank)")
    for name in (*VISION, *LLM, "F op", "B op"):
        m, p = measured[name] / per * 1e3, predicted[name] / per * 1e3
        print(f"{name:14s} {m:12.1f} {p:13.1f} {m / p if p else float('nan'):6.2f} "
              f"{cpu[name] / measured[name] if measured[name] else float('nan'):9.2f}")

    pool = Pool.from_shapes(read_shapes(shapes))
    load_line = cost.step_costs.loading(pool.load_features) if cost.step_costs and cost.step_costs.loading else None
    metrics = pd.read_parquet(Path(run) / "metrics.parquet").set_index("step")
    compute, loads, loads_pred = collections.Counter(), {}, {}
    for r in ops:
        compute[(r["step"], r["rank"])] += r["wall"]
    for f in sorted(Path(parts).glob("loads*.jsonl")):
        for line in open(f):
            d = json.loads(line)
            rows = np.array([int(k) for k in d["rows"]], dtype=np.int64)
            key = (d["step"] + 1, int(f.stem[5:]))
            loads[key] = sum(d["rows"].values())
            loads_pred[key] = float(load_line[rows].sum()) if load_line is not None and len(rows) else 0.0
    ranks = sorted({rank for _, rank in loads})
    rows = []
    for step in sorted(s for s in metrics.index if s >= FIRST_STEP):
        c = [compute[(step, r)] for r in ranks]
        lo = [loads.get((step, r), 0.0) for r in ranks]
        rows.append(dict(step=step, step_s=metrics.step_s[step], predicted_s=metrics.predicted_step_s[step],
                         priced_shape_s=max(a + b for a, b in zip(c, lo)), waiting_for_loads_s=max(lo) + max(c),
                         loads_s=sum(lo), loads_predicted_s=sum(loads_pred.get((step, r), 0.0) for r in ranks)))
    frame = pd.DataFrame(rows).set_index("step")
    frame["rest_s"] = frame.step_s - frame.waiting_for_loads_s
    print(frame.round(3).to_string())
    ratio = lambda col: (frame[col] / frame.predicted_s).median()  # noqa: E731
    print(f"median / predicted: measured {ratio('step_s'):.3f}, priced shape {ratio('priced_shape_s'):.3f}, "
          f"waiting for every load {ratio('waiting_for_loads_s'):.3f}; median rest {frame.rest_s.median():.3f} s; "
          f"loads measured / predicted (sum) {frame.loads_s.sum() / frame.loads_predicted_s.sum():.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("parts", "run", "costmodel", "shapes"):
        parser.add_argument(name)
    parser.add_argument("--vision-layers", type=int, default=2)
    parser.add_argument("--llm-layers", type=int, default=2)
    args = parser.parse_args()
    main(args.parts, args.run, args.costmodel, args.shapes, args.vision_layers, args.llm_layers)
