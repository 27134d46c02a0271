"""`profile_model` on a preset with profile settings given as keywords (the config's way)."""

from __future__ import annotations

from dflop.config import Config
from dflop.models.handle import ModelHandle
from dflop.profiling.model_profiler import profile_model

# A small grid: seconds per module on the tiny presets.
SMALL_GRID = dict(max_tiles=4, max_seq_len=128, repeats=2, warmup=1, min_measure_ms=40.0, max_repeats=4,
                  time_budget_s=60.0)


def profile(arch: str, vision: str, llm: str, out, *, min_seq_len: int = 16, progress: bool = False,
            model: dict | None = None, **settings):
    """profile_model of (arch, vision, llm) with `settings` as the config's ``profile`` section
    (alone on the machine unless `settings` names ``co_runners``); `model`: more ``model`` keys."""
    cfg = Config.from_dict({"model": {"arch": arch, "vision": vision, "llm": llm, **(model or {})},
                            "profile": settings})
    return profile_model(ModelHandle.resolve(cfg.model), cfg.profile, out, seed=0, min_seq_len=min_seq_len,
                         progress=progress, co_runners=cfg.profile.co_runners or 1)
