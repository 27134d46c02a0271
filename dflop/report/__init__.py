"""Plots for `snakemake --report`: one entry function per artifact group, each reading the
artifacts (docs/design.md) and writing PNG files (matplotlib, Agg backend).

- `plot_shape_histograms`: histograms.parquet -> shape histograms per dataset and modality
- `plot_costmodel_fit`: model_profile.parquet + costmodel.json + validation.parquet -> fit vs measurement
- `plot_plan`: plan.yaml (+ shapes, cost model) -> plan vs data-blind baseline, and a Gantt chart of each
- `plot_summary`: plan.yaml + the runs' metrics.parquet -> the report's first page (plan, speedup, idle)
- `plot_candidates`: candidates.parquet -> predicted step vs memory per candidate layout
- `plot_training_curves`: metrics.parquet -> throughput, TFLOP/s, loss, LR, step time, idle, waits
- `plot_timelines`: trace.json + plan.yaml -> one step measured beside the simulated one

The same functions run from the command line: ``python -m dflop.report GROUP ...`` (`dflop.report.command`).
"""


from __future__ import annotations

import importlib

# Loaded on first use (PEP 562), so `dflop --help` and `dflop.report.command` need no matplotlib.
_ENTRY_MODULES = {
    "plot_shape_histograms": "dflop.report.data_plots",
    "plot_costmodel_fit": "dflop.report.costmodel_plots",
    "plot_plan": "dflop.report.plan_plots",
    "plot_training_curves": "dflop.report.training_plots",
    "plot_summary": "dflop.report.summary_plots",
    "plot_candidates": "dflop.report.candidates_plots",
    "plot_timelines": "dflop.report.timeline_plots",
}
__all__ = sorted(_ENTRY_MODULES)


def __getattr__(name: str):
    if name in _ENTRY_MODULES:
        return getattr(importlib.import_module(_ENTRY_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
