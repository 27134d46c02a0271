"""The `dflop` command: one subcommand per workflow stage, each a thin call into the library.

Every stage takes its settings either from a YAML config file (``--config``) or, as the Snakemake
rules do, from a JSON object of just the sections it depends on (``--settings``), so that
Snakemake re-runs a stage exactly when a value it uses changes. Heavy imports (torch,
transformers) happen inside the subcommands so `dflop --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

from dflop import __version__
from dflop.config import Config, load
from dflop.errors import UserError
from dflop.report.command import add_arguments as add_report_arguments


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML config file (default: the demo default)")
    p.add_argument("--settings", help="JSON object laid over --config (what the Snakemake rules pass)")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _config(args: argparse.Namespace) -> Config:
    return load(args.config, args.settings)


def cmd_check_config(args: argparse.Namespace) -> None:
    # Beyond the schema, what the stages will look up: the model (presets, or the config.json in
    # model.weights, whose model then ignores model.llm), the vision preset (its tile geometry sets
    # the token rules even with model.weights) and every dataset (files opened, Parquet footers read).
    from dflop.models.architectures import architecture, check_compatible
    from dflop.models.handle import ModelHandle
    from dflop.models.presets import vision_preset
    from dflop.profiling.data_profiler import check_datasets

    cfg = _config(args)
    m = cfg.model
    ModelHandle.resolve(m)
    if m.weights is not None and not any(Path(m.weights).glob("*.safetensors")):
        raise UserError(f"model.weights: {m.weights} has no *.safetensors files (pickled checkpoints are not loaded)")
    check_compatible(architecture(m.arch), vision_preset(m.vision))
    demo = Path(cfg.data.demo.dir) / "demo.json"  # made by rule make_demo_data
    check_datasets(cfg, pending={demo})
    datasets = ", ".join(d.name + (" (to be made by make_demo_data)" if d.path == demo and not demo.exists() else "")
                         for d in cfg.datasets)
    print(f"config ok: arch={m.arch} vision={m.vision} llm={m.llm} datasets={datasets}")


def cmd_make_demo_data(args: argparse.Namespace) -> None:
    from dflop.data.demo import make_demo_data

    manifest = make_demo_data(args.out_dir, n_samples=args.n_samples, seed=args.seed)
    print(f"demo dataset written: {manifest}")


def cmd_profile_data(args: argparse.Namespace) -> None:
    from dflop.profiling.data_profiler import profile_data

    cfg = _config(args)
    workers = cfg.data.workers if args.workers is None else args.workers
    profile_data(cfg, shapes_path=args.shapes, histograms_path=args.histograms, workers=workers)


def cmd_profile_model(args: argparse.Namespace) -> None:
    from dflop.models.handle import ModelHandle
    from dflop.profiling.model_profiler import profile_model

    cfg = _config(args)
    profile_model(ModelHandle.resolve(cfg.model), cfg.profile, args.out, seed=cfg.seed,
                  co_runners=cfg.profile.co_runners_on(cfg.cluster))


def cmd_profile_loading(args: argparse.Namespace) -> None:
    from dflop.profiling.load_profiler import profile_loading

    cfg = _config(args)
    profile_loading(cfg, args.shapes, args.out, co_runners=cfg.profile.co_runners_on(cfg.cluster))


def cmd_fit(args: argparse.Namespace) -> None:
    from dflop.costmodel.fit import fit

    fit(args.profile, args.costmodel, args.validation, loading_path=args.loading)


def cmd_optimize(args: argparse.Namespace) -> None:
    from dflop.models.handle import ModelHandle
    from dflop.planner import optimize
    from dflop.scheduler.settings import SchedulerSettings

    cfg = _config(args)
    optimize(args.shapes, args.costmodel, args.plan, args.candidates, model=ModelHandle.resolve(cfg.model),
             cluster=cfg.cluster, planner=cfg.planner, global_batch_size=cfg.train.global_batch_size, seed=cfg.seed,
             datasets=cfg.datasets, scheduler=SchedulerSettings.of_config(cfg.scheduler).for_planning())


def cmd_simulate(args: argparse.Namespace) -> None:
    from dflop.planner import simulate_plan

    measured = _measured_agreement(args.metrics, args.plan)
    if measured is not None and (args.gpus or args.global_batch or args.shapes or args.costmodel):
        measured += " (measured on the plan as trained, not on this what-if)"
    simulate_plan(args.plan, gpus=args.gpus, global_batch=args.global_batch, shapes_path=args.shapes,
                  costmodel_path=args.costmodel, out_png=args.gantt, sample_batches_k=args.batches,
                  measured=measured)


def _measured_agreement(metrics: Path | None, plan: Path) -> str | None:
    """What the run's metrics.parquet (given, or the workflow's beside the plan) says about the
    predictions: a sentence for the what-if summary, None without a run. A run whose pipeline
    stages are not the plan's trained another plan: said, not compared."""
    from dflop.plan import read_plan
    from dflop.runtime.comparison import read_metrics
    from dflop.runtime.metrics import plan_stage_labels, prediction_agreement

    path = metrics if metrics is not None else plan.parent.parent / "train" / "metrics.parquet"
    if metrics is None and not path.exists():
        return None
    frame = read_metrics(path, missing_hint="--metrics: a training run's metrics.parquet",
                         columns=("step", "step_s", "predicted_step_s"))
    ran = sorted(c.removeprefix("busy_s_") for c in frame.columns if c.startswith("busy_s_"))
    planned = sorted(plan_stage_labels(read_plan(plan).plan))
    if ran and ran != planned:
        return (f"{path} is from a run of other pipeline stages ({', '.join(ran)}; this plan: "
                f"{', '.join(planned)}), so it says nothing about this plan's predictions")
    agreement = prediction_agreement(frame)
    return f"{path}: " + (agreement.describe() if agreement else "no steady-state steps yet")


def cmd_train(args: argparse.Namespace) -> None:
    from dflop.runtime.launch import main as launch_main

    code = launch_main(args.extra)
    if code:
        raise SystemExit(code)


def cmd_compare_runs(args: argparse.Namespace) -> None:
    from dflop.io import read_yaml
    from dflop.runtime.comparison import (HF_COLUMNS, compare_runs, compare_with_hf, planned_steps, read_metrics,
                                          summary_lines, write_summary)

    hint = "a training run's metrics.parquet (rules train and train_baseline)"
    predicted = planned_steps(read_yaml(args.plan, missing_hint="run `dflop optimize` first"), str(args.plan))
    plan = read_metrics(args.metrics, missing_hint=hint)
    comparison = compare_runs(plan, read_metrics(args.baseline_metrics, missing_hint=hint), predicted)
    hf = None
    if args.hf_metrics is not None:
        hf_hint = "the Hugging Face Trainer's metrics.parquet (dflop head-to-head)"
        hf = compare_with_hf(read_metrics(args.metrics, missing_hint=hint, columns=HF_COLUMNS),
                             read_metrics(args.hf_metrics, missing_hint=hf_hint, columns=HF_COLUMNS))
    if args.out is not None:
        inputs = {"plan_metrics": str(args.metrics), "baseline_metrics": str(args.baseline_metrics),
                  "plan": str(args.plan)}
        inputs.update({"hf_metrics": str(args.hf_metrics)} if args.hf_metrics is not None else {})
        write_summary(comparison, args.out, {"inputs": inputs}, hf=hf)
    print("\n".join(summary_lines(comparison, hf)), flush=True)


def cmd_head_to_head(args: argparse.Namespace) -> None:
    from dflop.config import parse_settings
    from dflop.integrations.head_to_head import head_to_head

    paths = head_to_head(str(args.config) if args.config else None, parse_settings(args.settings) if args.settings else None,
                         plan=args.plan, shapes=args.shapes, costmodel=args.costmodel, out_dir=args.out_dir,
                         baseline_dir=args.baseline_dir)
    for name, path in paths.items():
        print(f"{name}: {path}")


def cmd_report(args: argparse.Namespace) -> None:
    from dflop.report.command import run

    for path in run(args):
        print(f"wrote {path}")


def cmd_install_profile(args: argparse.Namespace) -> None:
    from dflop.profiles import install_profile, profile_argument

    dest = install_profile(args.name, args.dest, force=args.force)
    print(f"installed Snakemake profile {args.name!r} at {dest}; "
          f"run (from this directory): snakemake --profile {profile_argument(dest)} train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflop", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dflop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], None], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    p = add("check-config", cmd_check_config, "validate a config file against the schema")
    _add_config_args(p)

    p = add("make-demo-data", cmd_make_demo_data, "write the seeded LLaVA-format demo dataset with real media files")
    p.add_argument("--out-dir", type=Path, required=True, help="directory for demo.json and the media files")
    p.add_argument("--n-samples", type=int, default=300, help="samples to write (default: 300, data.demo.n_samples)")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples and media (default: 0, data.demo.seed)")

    p = add("profile-data", cmd_profile_data, "compute every sample's shape (shapes.parquet) and histograms")
    _add_config_args(p)
    p.add_argument("--shapes", type=Path, required=True, help="output shapes.parquet")
    p.add_argument("--histograms", type=Path, required=True, help="output histograms.parquet")
    p.add_argument("--workers", type=int, default=None, help="worker processes (0 = all cores; default: data.workers)")

    p = add("profile-model", cmd_profile_model,
            "time and memory of every model part over a shape grid and TP degrees (model_profile.parquet)")
    _add_config_args(p)
    p.add_argument("--out", type=Path, required=True, help="output model_profile.parquet")

    p = add("profile-loading", cmd_profile_loading,
            "time the trainer's load of a few samples per modality (load_profile.parquet)")
    _add_config_args(p)
    p.add_argument("--shapes", type=Path, required=True, help="input shapes.parquet")
    p.add_argument("--out", type=Path, required=True, help="output load_profile.parquet")

    p = add("fit", cmd_fit, "fit cost models on model_profile.parquet; write costmodel.json and validation.parquet")
    p.add_argument("--profile", type=Path, required=True, help="input model_profile.parquet")
    p.add_argument("--loading", type=Path, default=None,
                   help="input load_profile.parquet (dflop profile-loading): adds the per-sample load line")
    p.add_argument("--costmodel", type=Path, required=True, help="output costmodel.json")
    p.add_argument("--validation", type=Path, required=True, help="output validation.parquet (held-out errors)")

    p = add("optimize", cmd_optimize,
            "plan the 3D-parallel layout from the data and cost models (plan.yaml, candidates.parquet)")
    _add_config_args(p)
    p.add_argument("--shapes", type=Path, required=True, help="input shapes.parquet")
    p.add_argument("--costmodel", type=Path, required=True, help="input costmodel.json")
    p.add_argument("--plan", type=Path, required=True, help="output plan.yaml")
    p.add_argument("--candidates", type=Path, required=True, help="output candidates.parquet")

    p = add("simulate", cmd_simulate, "what-if: re-evaluate a plan on other data or GPU counts, draw its Gantt chart")
    p.add_argument("--plan", type=Path, required=True, help="input plan.yaml (written by dflop optimize)")
    p.add_argument("--gpus", type=_positive_int, default=None,
                   help="scale data parallelism to this many GPUs (the global batch scales with them)")
    p.add_argument("--global-batch", type=_positive_int, default=None,
                   help="global batch to simulate (default: the plan's, scaled with --gpus)")
    p.add_argument("--shapes", type=Path, default=None, help="other shapes.parquet (default: the plan's)")
    p.add_argument("--costmodel", type=Path, default=None, help="other costmodel.json (default: the plan's)")
    p.add_argument("--batches", type=int, default=None, help="global batches to sample (default: the plan's)")
    p.add_argument("--gantt", type=Path, default=None, help="write a Gantt chart of one simulated step (PNG)")
    p.add_argument("--metrics", type=Path, default=None,
                   help="metrics.parquet of a training run of this plan, to state how far its predictions were "
                        "off (default: ../train/metrics.parquet beside the plan's folder, when present)")

    # `dflop train` hands every argument to the launcher, which also runs inside each torchrun worker.
    train_help = "train with the plan: torchrun with the plan's world size (srun per node on Slurm)"
    p = sub.add_parser("train", help=train_help, description=train_help, add_help=False)
    p.set_defaults(func=cmd_train)

    p = add("compare-runs", cmd_compare_runs,
            "measured and predicted speedup of the plan's training run over the data-blind baseline's, and idle time")
    p.add_argument("--metrics", type=Path, required=True, help="the plan's metrics.parquet (rule train)")
    p.add_argument("--baseline-metrics", type=Path, required=True,
                   help="the baseline's metrics.parquet (rule train_baseline: dflop train --baseline)")
    p.add_argument("--plan", type=Path, required=True,
                   help="plan.yaml: the predicted steps of the plan and its baseline (over the sampled batches)")
    p.add_argument("--out", type=Path, default=None, help="write the comparison as YAML here (summary.yaml)")
    p.add_argument("--hf-metrics", type=Path, default=None,
                   help="the Hugging Face Trainer's metrics.parquet (dflop head-to-head): adds the speedup over it; "
                        "then --metrics and --baseline-metrics should be head-to-head's too (taken in turn)")

    p = add("head-to-head", cmd_head_to_head,
            "train the plan, its data-blind baseline and the Hugging Face Trainer side by side, one step each in turn")
    _add_config_args(p)
    p.add_argument("--plan", type=Path, required=True, help="plan.yaml")
    p.add_argument("--shapes", type=Path, required=True, help="shapes.parquet")
    p.add_argument("--costmodel", type=Path, help="costmodel.json (default: the analytic stand-in)")
    p.add_argument("--out-dir", type=Path, required=True,
                   help="the plan's and HF's runs (plan/, hf/), their logs and the shared pool")
    p.add_argument("--baseline-dir", type=Path, required=True, help="the baseline's run (metrics.parquet, trace.json)")

    p = add("report", cmd_report, "draw the report plots of one artifact group (summary, data, costmodel, plan, candidates, training, timeline)")
    add_report_arguments(p)

    p = add("install-profile", cmd_install_profile, "copy a Snakemake profile where `snakemake --profile NAME` finds it")
    p.add_argument("name", choices=["slurm", "local"], help="the profile: slurm (sbatch jobs) or local (one machine)")
    p.add_argument("--dest", type=Path, default=None,
                   help="parent directory (default ~/.config/snakemake; use . for ./NAME)")
    p.add_argument("--force", action="store_true", help="overwrite an existing profile")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.command == "train":
        args.extra = extra
    elif extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        args.func(args)
    except (UserError, FileNotFoundError) as exc:
        # Written to be read: one line naming the file, key or sample; no traceback.
        print(f"dflop {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
