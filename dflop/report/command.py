"""Command-line form of the report plots: ``dflop report GROUP --... --out PNG``.

`add_arguments` fills the parser of `dflop report` and `run` calls the
group's plot function. Importing this module is cheap: matplotlib and the planner load in `run`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

GROUPS = ("summary", "data", "costmodel", "plan", "candidates", "training", "timeline")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the GROUP subcommands and their file arguments to `parser`."""
    sub = parser.add_subparsers(dest="group", required=True, metavar="GROUP")
    p = sub.add_parser("summary", help="the report's first page: what was planned, predicted vs measured, speedup")
    p.add_argument("--plan", type=Path, required=True, help="input plan.yaml")
    p.add_argument("--metrics", type=Path, help="the plan's training metrics.parquet (absent: no run yet)")
    p.add_argument("--baseline-metrics", type=Path,
                   help="the data-blind baseline's training metrics.parquet (absent: no measured speedup)")
    p.add_argument("--out", type=Path, required=True, help="output PNG")

    p = sub.add_parser("data", help="shape histograms per dataset and modality (histograms.parquet)")
    p.add_argument("--histograms", type=Path, required=True, help="input histograms.parquet")
    p.add_argument("--out", type=Path, required=True, help="output PNG")

    p = sub.add_parser("costmodel", help="cost-model prediction vs profiled measurement, held-out error")
    p.add_argument("--profile", type=Path, required=True, help="input model_profile.parquet")
    p.add_argument("--costmodel", type=Path, required=True, help="input costmodel.json")
    p.add_argument("--validation", type=Path, required=True, help="input validation.parquet")
    p.add_argument("--out", type=Path, required=True, help="output PNG")

    p = sub.add_parser("plan", help="chosen plan vs data-blind baseline, and a Gantt chart of a simulated step of each")
    p.add_argument("--plan", type=Path, required=True, help="input plan.yaml")
    p.add_argument("--shapes", type=Path, help="shapes.parquet (default: the one recorded in plan.yaml)")
    p.add_argument("--costmodel", type=Path, help="costmodel.json (default: the one recorded in plan.yaml)")
    p.add_argument("--out", type=Path, required=True, help="output PNG: step time, memory and load per stage")
    p.add_argument("--gantt-plan", type=Path, required=True, help="output PNG: Gantt chart of the plan")
    p.add_argument("--gantt-baseline", type=Path, required=True, help="output PNG: Gantt chart of the baseline")

    p = sub.add_parser("candidates", help="the planner's candidates: predicted step vs memory, chosen and baselines")
    p.add_argument("--candidates", type=Path, required=True, help="input candidates.parquet")
    p.add_argument("--memory-limit-gb", type=float, help="GPU memory the planner allowed (default: plan.yaml's)")
    p.add_argument("--plan", type=Path, help="plan.yaml (its memory limit)")
    p.add_argument("--out", type=Path, required=True, help="output PNG")

    p = sub.add_parser("training", help="training curves: throughput, TFLOP/s, loss, LR, step time, idle, waits")
    p.add_argument("--metrics", type=Path, required=True, help="input metrics.parquet")
    p.add_argument("--peak-tflops", type=float, help="one device's peak TFLOP/s, for MFU (default: unknown)")
    p.add_argument("--devices", type=int, help="devices the run used (with --peak-tflops)")
    p.add_argument("--out", type=Path, required=True, help="output PNG")

    p = sub.add_parser("timeline", help="one traced step measured (trace.json) beside the simulated one")
    p.add_argument("--trace", type=Path, required=True, help="input trace.json (dflop train)")
    p.add_argument("--plan", type=Path, required=True, help="the plan.yaml the run trained")
    p.add_argument("--seed", type=int, required=True, help="the run's seed (run.seed): it picks the global batches")
    p.add_argument("--metrics", type=Path, help="the run's metrics.parquet (prints the trainer's own prediction)")
    p.add_argument("--step", type=int, help="step to draw (default: the last traced one)")
    p.add_argument("--shapes", type=Path, help="shapes.parquet (default: the one recorded in plan.yaml)")
    p.add_argument("--costmodel", type=Path, help="costmodel.json (default: the one recorded in plan.yaml)")
    p.add_argument("--out", type=Path, required=True, help="output PNG")


def run(args: argparse.Namespace) -> list[Path]:
    """Draw the plots of `args.group`; returns the PNG paths written."""
    import dflop.report as report

    if args.group == "data":
        return [report.plot_shape_histograms(histograms=args.histograms, out_png=args.out)]
    if args.group == "costmodel":
        return [report.plot_costmodel_fit(profile=args.profile, costmodel=args.costmodel,
                                          validation=args.validation, out_png=args.out)]
    if args.group == "plan":
        return report.plot_plan(plan=args.plan, shapes=args.shapes, costmodel=args.costmodel, out_png=args.out,
                                gantt_plan_png=args.gantt_plan, gantt_baseline_png=args.gantt_baseline)
    if args.group == "training":
        if (args.peak_tflops is None) != (args.devices is None):
            from dflop.errors import UserError
            raise UserError("--peak-tflops and --devices go together (MFU needs both)")
        return [report.plot_training_curves(metrics=args.metrics, out_png=args.out, peak_tflops=args.peak_tflops,
                                            devices=args.devices)]
    if args.group == "summary":
        return [report.plot_summary(plan=args.plan, metrics=args.metrics, baseline_metrics=args.baseline_metrics,
                                    out_png=args.out)]
    if args.group == "candidates":
        return [report.plot_candidates(candidates=args.candidates, memory_limit_gb=args.memory_limit_gb,
                                       plan=args.plan, out_png=args.out)]
    if args.group == "timeline":
        return [report.plot_timelines(trace=args.trace, plan=args.plan, seed=args.seed, metrics=args.metrics,
                                      step=args.step, shapes=args.shapes, costmodel=args.costmodel, out_png=args.out)]
    raise ValueError(f"unknown report group {args.group!r}; known: {', '.join(GROUPS)}")
