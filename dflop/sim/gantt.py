"""Gantt chart of one simulated step: one row per device, forward, backward and weight-gradient
ops as bars."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from dflop.sim.pipeline import SimResult  # noqa: E402

_FWD = "#4C72B0"
_BWD = "#DD8452"
_WGRAD = "#55A868"


def _device_label(result: SimResult, device: int) -> str:
    row = int(np.flatnonzero(result.row_device == device)[0])
    s, r = int(result.row_stage[row]), int(result.row_replica[row])
    if s < result.n_vision_stages:
        return f"vision s{s}"
    s_llm = s - result.n_vision_stages
    if result.chunks > 1:  # the device's first row is its rank's first chunk: virtual stage = rank
        name = f"llm rank {s_llm}" if result.n_vision_stages else f"rank {s_llm}"
    else:
        name = f"llm s{s_llm}" if result.n_vision_stages else f"stage {s}"
    multi = (result.row_stage == s).sum() > 1
    return f"{name} r{r}" if multi else name


def plot_gantt(result: SimResult, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG Gantt chart of `result` to `path` and return the path.

    Rows are devices (first stage at the top; under interleaving a rank's chunks share its row),
    blue bars forwards, orange bars backwards (input gradients under a split backward), green bars
    weight gradients, each labelled with its microbatch id when wide enough; idle time is the white
    space. Units: seconds.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_rows, m = result.fwd_start.shape
    n_dev = result.n_devices
    span = max(result.makespan_s, 1e-12)
    fig_h = 1.2 + 0.45 * n_dev
    fig, ax = plt.subplots(figsize=(min(4 + 0.25 * m * 2 * result.chunks, 24), fig_h))
    min_label_w = span / 60  # only bars wider than ~1/60 of the step get a text label
    kinds = [(result.fwd_start, result.fwd_end, _FWD), (result.bwd_start, result.bwd_end, _BWD)]
    if result.w_start is not None:
        kinds.append((result.w_start, result.w_end, _WGRAD))
    for row in range(n_rows):
        y = n_dev - 1 - int(result.row_device[row])
        for start, end, colour in kinds:
            has = np.isfinite(start[row])  # rows without a split backward have no W ops
            widths = end[row] - start[row]
            ax.barh(y, widths[has], left=start[row][has], height=0.8, color=colour, edgecolor="black",
                    linewidth=0.4)
            for j in np.flatnonzero(has & (widths >= min_label_w)):
                ax.text(start[row, j] + widths[j] / 2, y, str(j), ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(n_dev))
    ax.set_yticklabels([_device_label(result, d) for d in range(n_dev)][::-1])
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"{result.schedule.upper()} step {result.step_s:.4g} s, "
                 f"{m} microbatches, idle {100 * result.idle_fraction():.1f}%")
    handles = [Patch(color=_FWD, label="forward"), Patch(color=_BWD, label="backward")]
    if result.w_start is not None:
        handles = [handles[0], Patch(color=_BWD, label="input grad"), Patch(color=_WGRAD, label="weight grad")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
