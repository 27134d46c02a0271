"""DFLOP's sampler inside the Hugging Face Trainer, side by side with the Trainer's own samplers.

    python benchmarks/bench_hf_trainer.py [--config FILE] [--preset tiny|small] [--rounds 3]
        [--steps N] [--costmodel PATH] [--work DIR] [--quick]

One torchrun of 2 gloo ranks (one torch thread each) trains transformers'
`LlavaOnevisionForConditionalGeneration` (the config's model, or `--preset`'s; random weights,
seed ``run.seed``) on the config's datasets (default: config/config.yaml, the demo data, made and
profiled into ``--work`` if missing), with the config's ``train.global_batch_size`` over 2 ranks x
2 accumulation steps, and AdamW at ``train.lr``. Variants, each a fresh model and `Trainer`:

- ``hf_random``, ``hf_group_by_length``, ``hf_batch_rebalance``: HF's `Trainer` with
  ``train_sampling_strategy`` of that name; samples padded to the longest of their microbatch
  (`LlavaOnevisionCollator`, as LLaVA-OV's training code batches);
- ``dflop_padded``: `dflop.integrations.hf.DflopTrainer` (DFLOP's sampler), same padded collator;
- ``dflop_packed``: DFLOP's sampler with each microbatch packed into one row (what DFLOP's costs price);
- ``dflop_train``: `dflop train` (DFLOP's own executor: packed rows, its planned partition) on the
  same pool, seeded global batches and a pp = 1 plan (2 data-parallel ranks x 2 microbatches), its
  own launch, before the HF Trainer's variants in even rounds and after them in odd ones; its
  numbers come from its metrics.parquet (rank wait: its stage's ``idle_s``, from its own spans, not
  thread CPU time; no activation peak). Its optimizer (warm-up + cosine) is not the HF variants'.

Every variant trains the same number of steps from step 0 of epoch 0 (default: the whole epoch, so
each trains on the same samples, grouped differently); rounds run the variants interleaved,
rotated one place per round, so the VM's speed phases hit all alike. Per variant and round:
samples/s and tokens/s (real tokens, padding excluded) over the steps after the first (warm-up),
step wall = one optimizer step end to the next (data loading, forward, backward, gradient
all-reduce, AdamW); rank wait = wall seconds a rank's main thread did not compute (thread CPU time
against wall: waiting for the other rank in DDP's all-reduce, or descheduled), per step, mean over
ranks. The table shows medians over rounds. Peak activations: the most bytes autograd held for
backward at once on either rank (`dflop.profiling._memory.live_saved_tensor_bytes`: what the
microbatches' composition drives, parameters and optimizer state alike in every variant), from one
extra, untimed pass of every variant after the last round (the hooks slow the step).

Loss check: ``dflop_padded`` and ``dflop_packed`` train the same global batches (DFLOP's sampler),
so their per-step losses (the exact mean over the batch's answer tokens) must agree; the largest
relative difference is printed and a difference above 1e-3 fails the run. ``dflop_train`` trains
the same global batches from the same initial weights, so its first step's loss (before any update)
must equal ``dflop_padded``'s within the same tolerance.

HF's LLaVA-OV takes a batch's videos as one [videos, frames, ...] tensor, so videos shorter than
the model's ``video_frames`` (fewer frames) are left out of the pool for every variant alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

HF_VARIANTS = ("hf_random", "hf_group_by_length", "hf_batch_rebalance", "dflop_padded", "dflop_packed")
VARIANTS = HF_VARIANTS + ("dflop_train",)
PRESETS = {"tiny": ("siglip-tiny", "qwen2.5-tiny"), "small": ("siglip-small", "qwen2.5-small")}
WORLD, ACCUM = 2, 2
LOSS_RTOL = 1e-3


def load_config(path: str, preset: str | None, work: Path):
    """The config, its demo data made under `work` when the demo dataset is missing."""
    from dflop import config

    raw = config.load_yaml(path)
    if preset is not None:
        vision, llm = PRESETS[preset]
        raw.setdefault("model", {}).update(vision=vision, llm=llm)
    cfg = config.Config.from_dict(raw)
    demo = Path(cfg.data.demo.dir) / "demo.json"
    uses_demo = any(Path(d.path) == demo for d in cfg.datasets)
    if uses_demo and not demo.exists():
        raw["data"]["datasets"] = [{**d, "path": str(work / "demo" / "demo.json")} if Path(d["path"]) == demo else d
                                   for d in raw["data"]["datasets"]]
        cfg = config.Config.from_dict(raw)
    return cfg, raw


def prepare(cfg, work: Path, n_demo: int | None) -> Path:
    """shapes.parquet of the config's datasets under `work` (demo data made first where needed)."""
    from dflop.data.demo import make_demo_data
    from dflop.profiling.data_profiler import profile_data

    work.mkdir(parents=True, exist_ok=True)
    for d in cfg.datasets:
        if not Path(d.path).exists() and Path(d.path).parent == work / "demo":
            make_demo_data(work / "demo", n_samples=n_demo or cfg.data.demo.n_samples, seed=cfg.data.demo.seed)
    shapes = work / "shapes.parquet"
    if not shapes.exists():
        profile_data(cfg, shapes_path=shapes, histograms_path=work / "histograms.parquet", workers=1, progress=False)
    return shapes


def training_pool(shapes_path: Path, video_frames: int, limit: int | None):
    """The usable shapes rows HF's LLaVA-OV can batch (`dflop.integrations.hf_run.hf_pool`), the first `limit`."""
    from dflop.integrations.hf_run import hf_pool
    from dflop.shapes import read_shapes

    pool = hf_pool(read_shapes(shapes_path), video_frames)
    return pool.head(limit).reset_index(drop=True) if limit else pool


def run_variant(name: str, cfg, pool, data, items, steps: int, out_dir: Path, memory: bool = False) -> dict:
    """Train `steps` optimizer steps of variant `name` from a fresh model: every rank's measurements.
    memory: track the bytes autograd holds for backward (slower: an untimed pass)."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer

    from dflop.integrations.hf import DflopTrainer, LlavaOnevisionCollator, Sampling
    from dflop.integrations.hf_run import (StepRecorder, per_device_batch, recording_trainer, step_callback,
                                           training_arguments)
    from dflop.models.builder import build_model
    from dflop.profiling._memory import live_saved_tensor_bytes

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.arch, cfg.model.vision, cfg.model.llm, seed=cfg.seed, llm_attention="sdpa")
    collator = LlavaOnevisionCollator(data, 0, pack=name == "dflop_packed")
    recorder = StepRecorder()
    strategy = name.removeprefix("hf_") if name.startswith("hf_") else "random"
    args = training_arguments(cfg, out_dir / "hf" / name, per_device=per_device_batch(
        cfg.train.global_batch_size, WORLD, ACCUM), accum=ACCUM, steps=steps, strategy=strategy)
    common = dict(model=model, args=args, train_dataset=items, data_collator=collator,
                  callbacks=[step_callback(recorder)])
    if name.startswith("dflop"):
        trainer = recording_trainer(DflopTrainer, recorder)(
            **common, dflop=Sampling.from_config(cfg, shapes=pool, costmodel=OPTIONS["costmodel"]))
    else:
        trainer = recording_trainer(Trainer, recorder)(**common)
    if memory:
        with live_saved_tensor_bytes(exclude=list(model.parameters())) as held:
            trainer.train()
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, held.peak)
        return {"peak_bytes": max(peaks)}
    trainer.train()
    del trainer, model
    return recorder.gathered()


OPTIONS: dict = {}


def worker(opts) -> None:
    """One rank: every variant, `opts.rounds` rounds, interleaved and rotated."""
    import torch
    import torch.distributed as dist

    from dflop.cpu_memory import reuse_large_cpu_allocations
    from dflop.data.training import TrainingData, pool_samples
    from dflop.integrations.hf import TokenItems
    from dflop.models.handle import ModelHandle
    from dflop.runtime.process_group import end_worker

    reuse_large_cpu_allocations()
    torch.set_num_threads(1)
    work = Path(opts.work)
    cfg, _ = load_config(opts.config, opts.preset, work)
    OPTIONS["costmodel"] = opts.costmodel
    handle = ModelHandle.resolve(cfg.model)
    rules = handle.sample_rules()
    pool = training_pool(work / "shapes.parquet", int(rules.arch_params["video_frames"]), opts.limit)
    data = TrainingData(pool_samples(pool, cfg.datasets, cfg.seed), rules)

    class CachedItems(TokenItems):  # HF's length samplers read every item once per Trainer: tokenise once
        cache: dict = {}

        def __getitem__(self, i):
            if i not in self.cache:
                self.cache[i] = super().__getitem__(i)
            return self.cache[i]

    items = CachedItems(data)
    steps = opts.steps or len(pool) // cfg.train.global_batch_size
    variants = [v for v in opts.variants if v in HF_VARIANTS]
    results: dict = {v: [] for v in variants}
    memory: dict = {}
    r = opts.round_index
    for name in variants[r % len(variants):] + variants[:r % len(variants)]:
        began = time.perf_counter()
        results[name].append(run_variant(name, cfg, pool, data, items, steps, work))
        if dist.get_rank() == 0:
            print(f"round {r} {name}: {time.perf_counter() - began:.1f} s", flush=True)
    if opts.with_memory:  # after the timed round: the hooks would slow it
        memory = {name: run_variant(name, cfg, pool, data, items, steps, work, memory=True)["peak_bytes"]
                  for name in variants}
    if dist.get_rank() == 0:
        meta = {"pool": len(pool), "steps": steps, "global_batch_size": cfg.train.global_batch_size,
                "model": f"{cfg.model.arch}/{cfg.model.vision}/{cfg.model.llm}"}
        Path(opts.out).write_text(json.dumps({"meta": meta, "results": results, "peak_saved_bytes": memory}))
    end_worker()


def write_pool_shapes(cfg, work: Path, limit: int | None) -> Path:
    """The benchmark's pool as a shapes.parquet of its own (what `dflop train` reads)."""
    from dflop.models.handle import ModelHandle

    rules = ModelHandle.resolve(cfg.model).sample_rules()
    path = work / "pool_shapes.parquet"
    training_pool(work / "shapes.parquet", int(rules.arch_params["video_frames"]), limit).to_parquet(path, index=False)
    return path


def run_dflop_train(opts, cfg, raw: dict, work: Path, r: int, steps: int) -> dict:
    """`dflop train` (packed, planned: DFLOP's own executor) on the same pool, the same seeded global
    batches and the pp = 1 plan the HF variants run (2 data-parallel ranks x 2 microbatches, the
    whole model on each rank); its metrics.parquet as this benchmark's measurements."""
    import pandas as pd
    import yaml

    from dflop.integrations.hf import hf_plan
    from dflop.models.handle import ModelHandle

    plan = hf_plan(ModelHandle.resolve(cfg.model), WORLD, ACCUM)
    plan_path = work / "plan_pp1.yaml"
    plan_path.write_text(yaml.safe_dump(plan.to_dict(cfg.train.global_batch_size)))
    config_path = work / "config_used.yaml"
    config_path.write_text(yaml.safe_dump({**raw, "train": {**raw.get("train", {}), "checkpoint_every": 0}}))
    out = work / "dflop_train" / f"round{r}"
    cmd = [sys.executable, "-m", "dflop.runtime.launch", "--config", str(config_path), "--plan", str(plan_path),
           "--shapes", str(work / "pool_shapes.parquet"), "--out-dir", str(out), "--steps", str(steps),
           "--no-export", "--fresh"]
    cmd += ["--costmodel", opts.costmodel] if opts.costmodel else []
    began = time.perf_counter()
    subprocess.run(cmd, check=True, env=worker_env())
    print(f"round {r} dflop_train: {time.perf_counter() - began:.1f} s", flush=True)
    m = pd.read_parquet(out / "metrics.parquet").sort_values("step")
    idle = [c for c in m.columns if c.startswith("idle_s_")]
    return {"samples": m["samples"].tolist(), "tokens": m["tokens"].tolist(), "loss": m["loss"].tolist(),
            "wall_s": m["step_s"].tolist(), "wait_s": m[idle].mean(axis=1).tolist()}


def worker_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def summarise(doc: dict) -> tuple[str, list[str]]:
    """(the markdown table, problems) of the worker's results."""
    lines = ["| variant | samples/s | tokens/s | step s | rank wait s/step | peak activations MB | rounds |",
             "|---|---|---|---|---|---|---|"]
    for name, rounds in doc["results"].items():
        sps, tps, step, wait = [], [], [], []
        for r in rounds:
            wall = np.array(r["wall_s"][1:])  # after the warm-up step
            sps.append(sum(r["samples"][1:]) / wall.sum())
            tps.append(sum(r["tokens"][1:]) / wall.sum())
            step.append(float(np.median(wall)))
            wait.append(float(np.mean(r["wait_s"][1:])))
        lines.append(f"| {name} | {np.median(sps):.2f} | {np.median(tps):.0f} | {np.median(step):.2f} | "
                     f"{np.median(wait):.2f} | {peak_mb(doc, name)} | {len(rounds)} |")
    problems = []
    res = doc["results"]
    if "dflop_train" in res and "dflop_padded" in res and res["dflop_train"] and res["dflop_padded"]:
        # Same global batches and initial weights; the optimizers differ (dflop's warm-up + cosine
        # and clipping), so only the first step, before any update, must agree.
        first = [(t["loss"][0], p["loss"][0]) for t, p in zip(res["dflop_train"], res["dflop_padded"])]
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in first)
        lines.append(f"\nloss check: dflop_train vs dflop_padded, first step (same batch, same initial weights), "
                     f"largest relative difference {worst:.2e} (tolerance {LOSS_RTOL:g})")
        if not worst <= LOSS_RTOL:
            problems.append(f"dflop_train's first loss differs from dflop_padded's by {worst:.2e} (relative)")
    if "dflop_padded" in res and "dflop_packed" in res:
        worst = 0.0
        for a, b in zip(res["dflop_padded"], res["dflop_packed"]):
            la, lb = np.array(a["loss"]), np.array(b["loss"])
            worst = max(worst, float(np.max(np.abs(la - lb) / np.maximum(np.abs(la), 1e-12))))
        lines.append(f"\nloss check: dflop_padded vs dflop_packed (same global batches), largest relative "
                     f"difference over steps and rounds {worst:.2e} (tolerance {LOSS_RTOL:g})")
        if not worst <= LOSS_RTOL:
            problems.append(f"dflop_padded and dflop_packed losses differ by {worst:.2e} (relative)")
    return "\n".join(lines), problems


def peak_mb(doc: dict, name: str) -> str:
    peak = doc.get("peak_saved_bytes", {}).get(name)
    return "n/a" if peak is None else f"{peak / 2**20:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "config" / "config.yaml"))
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="override the config's model with this preset's tower and LLM")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per variant (0: one epoch)")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N samples of the pool")
    parser.add_argument("--costmodel", default=None, help="costmodel.json for DFLOP's sampler (default: analytic)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--work", default=None, help="data and results (default /tmp/bench_hf_trainer[_quick])")
    parser.add_argument("--quick", action="store_true", help="smoke test: 60 demo samples, 3 steps, 1 round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--round-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--with-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    opts.variants = [v for v in opts.variants.split(",") if v]
    unknown = sorted(set(opts.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if opts.worker:
        return worker(opts)
    if opts.quick:
        opts.rounds, opts.steps = 1, opts.steps or 3
    opts.work = opts.work or "/tmp/bench_hf_trainer" + ("_quick" if opts.quick else "")
    work = Path(opts.work)
    cfg, raw = load_config(opts.config, opts.preset, work)
    began = time.perf_counter()
    prepare(cfg, work, 60 if opts.quick else None)
    import pandas as pd

    pool_size = len(pd.read_parquet(write_pool_shapes(cfg, work, opts.limit)))
    steps = opts.steps or pool_size // cfg.train.global_batch_size

    def hf_run(extra: list[str], out: Path) -> dict:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               __file__, "--worker", "--config", opts.config, "--steps", str(steps), "--limit", str(opts.limit),
               "--variants", ",".join(opts.variants), "--work", str(work), "--out", str(out), *extra]
        cmd += ["--preset", opts.preset] if opts.preset else []
        cmd += ["--costmodel", opts.costmodel] if opts.costmodel else []
        subprocess.run(cmd, check=True, env=worker_env())
        return json.loads(out.read_text())

    doc: dict = {"results": {v: [] for v in opts.variants}}
    hf = [v for v in opts.variants if v in HF_VARIANTS]
    for r in range(opts.rounds):
        # dflop train is its own launch: before the HF Trainer's variants in even rounds, after in odd ones.
        if "dflop_train" in opts.variants and r % 2 == 0:
            doc["results"]["dflop_train"].append(run_dflop_train(opts, cfg, raw, work, r, steps))
        if hf:
            last = ["--with-memory"] if r == opts.rounds - 1 else []
            part = hf_run(["--round-index", str(r), *last], work / f"hf_round{r}.json")
            doc["meta"] = part["meta"]
            doc["peak_saved_bytes"] = part["peak_saved_bytes"]
            for name, rounds in part["results"].items():
                doc["results"][name] += rounds
        if "dflop_train" in opts.variants and r % 2 == 1:
            doc["results"]["dflop_train"].append(run_dflop_train(opts, cfg, raw, work, r, steps))
    doc.setdefault("meta", {"pool": pool_size, "steps": steps,
                            "global_batch_size": cfg.train.global_batch_size,
                            "model": f"{cfg.model.arch}/{cfg.model.vision}/{cfg.model.llm}"})
    (work / "bench_hf_trainer.json").write_text(json.dumps(doc))
    table, problems = summarise(doc)
    meta = doc["meta"]
    print(f"\n{platform.node()} {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d', time.gmtime())}; {meta['model']}, "
          f"{meta['pool']} samples, global batch {meta['global_batch_size']} = {WORLD} ranks x {ACCUM} "
          f"microbatches, {meta['steps']} steps per variant; {time.perf_counter() - began:.0f} s in all\n")
    print(table)
    if problems:
        sys.exit("bench_hf_trainer: " + "; ".join(problems))


if __name__ == "__main__":
    main()
