"""Column and module names of `model_profile.parquet` that the profiler writes and the cost model
reads: one home, importable without torch (the cost model's readers and plots run without it)."""

from __future__ import annotations

from dflop.plan import RECOMPUTE_MODES

#: Per recompute mode other than none, the profile columns and cost-model targets of a layer module
#: under it: the backward including the recomputed forward, and the bytes kept for backward.
RECOMPUTE_TARGETS = {mode: (f"bwd_ms:{mode}", f"act_bytes:{mode}") for mode in RECOMPUTE_MODES if mode != "none"}

#: Per recompute mode, the column of the bytes a module's forward + backward holds at its peak
#: beyond what it saves (none: every module; the other modes: layer modules).
TRANSIENT_TARGETS = {"none": "transient_bytes", **{mode: f"transient_bytes:{mode}" for mode in RECOMPUTE_TARGETS}}

#: The profile's link rows (not modules): the gradient all-reduce and the pipeline's P2P sweeps.
LINK_MODULES = ("allreduce", "p2p")
