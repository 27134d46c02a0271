"""Command-line form of the report plots: ``dflop report GROUP --... --out PNG``.

`add_arguments` fills the parser of `dflop report` and `run` calls the
group's plot function. Importing this module is cheap: matplotlib and the planner load in `run`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

GROUPS = ("data", "costmodel", "plan", "training")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the GROUP subcommands and their file arguments to `parser`."""
    sub = parser.add_subparsers(dest="group", required=True, metavar="GROUP")
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

    p = sub.add_parser("training", help="training curves: loss, step time measured vs predicted, idle share")
    p.add_argument("--metrics", type=Path, required=True, help="input metrics.parquet")
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
        return [report.plot_training_curves(metrics=args.metrics, out_png=args.out)]
    raise ValueError(f"unknown report group {args.group!r}; known: {', '.join(GROUPS)}")
