"""`dflop fit`: fit the cost models on a model profile, report held-out error, save JSON.

One non-negative linear regressor per (module, tp, target) on relative error (transients on
absolute bytes: `_regressor`), target in
fwd_ms / bwd_ms / act_bytes, plus the optional targets of a module whose every profiled shape has
them: the recompute targets ``bwd_ms:<mode>`` / ``act_bytes:<mode>`` (the profiler measures them
for the layer modules; an older profile lacks them and its model then prices recompute none
only) and the transients ``transient_bytes`` / ``transient_bytes:<mode>`` (an older profile's are
derived from its CUDA peaks, `dflop.costmodel.profile_table`; without either, its model prices
them 0), features from `dflop.costmodel.features`. The held-out error of
each is measured by leaving one profiled shape out at a time (`dflop.costmodel.validation`) and
written to ``validation.parquet``:

    module, tp, target, n_train_shapes, n_test_shapes, mape_median, mape_p90, mape_max

with the errors in percent. The profile's optimizer and link measurements become the model's
``step_costs`` (`fit_step_costs`: a line in bytes per kind); a load profile
(`dflop.profiling.load_profiler`, ``--loading``) becomes its per-sample load line (`fit_load_line`).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import replace
import logging
from importlib.metadata import PackageNotFoundError, version
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

from dflop.costmodel.features import module_features, profile_features
from dflop.costmodel.jsonio import save_cost_model
from dflop.costmodel.model import (LOAD_FEATURES, OPTIONAL_TARGETS, TARGETS, TRANSIENT, BytesLine, CostModel, LoadLine,
                                  ModuleCosts, Provenance, StepCosts)
from dflop.costmodel.profile_table import ProfileSummary, read_profile
from dflop.costmodel.regressor import NonNegativeLinearRegression
from dflop.costmodel.validation import leave_one_shape_out
from dflop.errors import UserError
from dflop.finite import Numbers, check_columns
from dflop.io import atomic_path, read_parquet

log = logging.getLogger(__name__)

VALIDATION_COLUMNS = (
    "module", "tp", "target", "n_train_shapes", "n_test_shapes", "mape_median", "mape_p90", "mape_max",
)


def fit(profile_path: str | Path, out_json: str | Path, out_validation: str | Path,
        loading_path: str | Path | None = None) -> CostModel:
    """Fit on `profile_path` (model_profile.parquet) and, when given, `loading_path`
    (load_profile.parquet); write the model JSON and validation.parquet.

    Both outputs are written atomically; the held-out errors are also logged (logger
    ``dflop.costmodel.fit``, level INFO).
    """
    profile_path = Path(profile_path)
    summary = read_profile(profile_path)
    model, validation = fit_profile(
        summary, profile=str(profile_path), profile_sha256=_sha256(profile_path))
    if loading_path is not None:
        loading = fit_load_line(read_parquet(loading_path, missing_hint="run `dflop profile-loading` first"),
                                where=str(loading_path))
        model = CostModel(model.modules.values(), model.provenance, replace(model.step_costs, loading=loading))
        log.info("load line from %s (%d samples), ms: %s", loading_path, loading.n_samples,
                 ", ".join(f"{name} {1e3 * c:.4g}" for name, c in zip(LOAD_FEATURES, loading.coef)))
    save_cost_model(model, out_json)
    with atomic_path(out_validation) as tmp:
        validation.to_parquet(tmp, index=False)
    log.info("cost model fitted on %s (%s, %s, %d rows):\n%s", profile_path, summary.device,
             summary.dtype, summary.n_rows, format_validation(validation))
    log.info("wrote %s and %s", out_json, out_validation)
    return model


def fit_profile(
    summary: ProfileSummary, *, profile: str = "", profile_sha256: str = ""
) -> tuple[CostModel, pd.DataFrame]:
    """Fit every (module, tp) of a profile summary; returns the model and the validation table."""
    modules = []
    rows = []
    step_costs = fit_step_costs(summary.step_costs)
    optimizer_s = module_optimizer_s(summary.step_costs, step_costs.optimizer_call_s)
    for (module, tp), shapes in summary.shapes.groupby(["module", "tp"], sort=True):
        features = module_features(module, summary.device)
        if len(shapes) < len(features):
            log.warning("%s at tp=%s: %d profiled shape(s) for %d features (%s); its fit is underdetermined",
                        module, tp, len(shapes), len(features), ", ".join(features))
        X = profile_features(features, shapes["batch"].to_numpy(), shapes["seq_len"].to_numpy())
        coef = {}
        for target in TARGETS + _measured_optional_targets(shapes, module, tp):
            y = shapes[target].to_numpy(dtype=np.float64)
            regressor = _regressor(target)
            coef[target] = tuple(float(c) for c in regressor().fit(X, y).coef_)
            held_out = leave_one_shape_out(X, y, regressor)
            rows.append({
                "module": module, "tp": int(tp), "target": target,
                "n_train_shapes": held_out.n_train_shapes, "n_test_shapes": held_out.n_test_shapes,
                "mape_median": held_out.median, "mape_p90": held_out.p90, "mape_max": held_out.max,
            })
        modules.append(ModuleCosts(
            module=module,
            tp=int(tp),
            features=features,
            coef=coef,
            param_bytes=float(shapes["param_bytes"].median()),
            tied_param_bytes=float(shapes["tied_bytes"].median()),
            optimizer_s=optimizer_s.get((module, int(tp)),  # no parameters: nothing to step
                                        0.0 if optimizer_s and not shapes["param_bytes"].median() else None),
            n_shapes=len(shapes),
            profiled_batch=(int(shapes["batch"].min()), int(shapes["batch"].max())),
            profiled_seq_len=(int(shapes["seq_len"].min()), int(shapes["seq_len"].max())),
        ))
    provenance = Provenance(
        preset=summary.preset,
        device=summary.device,
        dtype=summary.dtype,
        profile=profile,
        profile_sha256=profile_sha256,
        n_profile_rows=summary.n_rows,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        dflop_version=_dflop_version(),
    )
    validation = pd.DataFrame(rows, columns=list(VALIDATION_COLUMNS))
    return CostModel(modules, provenance, step_costs), validation


def fit_step_costs(rows: pd.DataFrame | None) -> StepCosts:
    """Lines in bytes through the optimizer and link measurements (`ProfileSummary.step_costs`),
    non-negative and on relative error like the module fits; a kind needs two distinct sizes."""

    def line(points: pd.DataFrame) -> BytesLine | None:
        if points["bytes"].nunique() < 2:
            return None
        X = np.column_stack([np.ones(len(points)), points["bytes"].to_numpy(dtype=np.float64)])
        const, per_byte = NonNegativeLinearRegression().fit(X, points["ms"].to_numpy(dtype=np.float64)).coef_
        return BytesLine(float(const) * 1e-3, float(per_byte) * 1e-3)

    if rows is None:
        return StepCosts()
    allreduce = {int(ranks): line(group) for ranks, group in rows[rows["kind"] == "allreduce"].groupby("ranks")}
    call = rows.loc[rows["kind"] == "optimizer_call", "ms"]
    return StepCosts(optimizer=line(rows[rows["kind"] == "optimizer"]),
                     allreduce={ranks: fitted for ranks, fitted in allreduce.items() if fitted is not None},
                     p2p=line(rows[rows["kind"] == "p2p"]),
                     optimizer_call_s=float(call.median()) * 1e-3 if len(call) else None)


def module_optimizer_s(rows: pd.DataFrame | None, call_s: float | None) -> dict[tuple[str, int], float]:
    """{(module, tp): seconds of the optimizer step on its parameters beyond the step's own cost
    `call_s` (`StepCosts.optimizer_call_s`)}: `ModuleCosts.optimizer_s`, the module's measured step
    less the call, per layer for layer modules, at least 0; empty without a measured call. A module
    without parameters has no step in the profile (`fit_profile` gives it 0)."""
    if rows is None or call_s is None:
        return {}

    def layers(n) -> float:  # a stacked layer module's step covers n_layers layers; other modules one
        return float(n) if np.isfinite(float(n)) and float(n) > 1 else 1.0

    return {(str(r.module), int(r.tp)): max(0.0, float(r.ms) * 1e-3 - call_s) / layers(r.n_layers)
            for r in rows[rows["kind"] == "optimizer"].itertuples(index=False)}


def fit_load_line(table: pd.DataFrame, *, where: str = "load profile") -> LoadLine:
    """The per-sample load line (`LoadLine`) through a load profile's timings: non-negative least
    squares on absolute seconds, so the line is right where it matters, on the sum over a batch,
    which the heavy samples (videos) dominate."""
    missing = [c for c in (*LOAD_FEATURES[1:], "load_s") if c not in table.columns]
    if missing:
        raise UserError(f"{where}: not a load profile, missing columns {missing}")
    if table.empty:
        raise UserError(f"{where}: no timed sample")
    check_columns(table, where, {**{c: Numbers(0, whole=True) for c in LOAD_FEATURES[1:]}, "load_s": Numbers(0)},
                  (lambda i: f"sample {table['sample_id'].iloc[i]!r}") if "sample_id" in table.columns else None)
    X = np.column_stack([np.ones(len(table))] + [table[c].to_numpy(dtype=np.float64) for c in LOAD_FEATURES[1:]])
    coef = NonNegativeLinearRegression(relative=False).fit(X, table["load_s"].to_numpy(dtype=np.float64)).coef_
    return LoadLine(tuple(float(c) for c in coef), n_samples=len(table))


def _regressor(target: str):
    """The regressor of a target: relative error, except for transients, fitted on absolute bytes.

    A module's transient is the larger of peaks that come one after the other (the LM head's: the
    loss's backward, growing with the tokens, then the weight's gradient, a constant; from a
    profile's CUDA peaks, ``peak - act - grad``, 0 at small shapes), a bend no non-negative line in
    the features follows; on relative error its small shapes pulled the slope that decides a large
    microbatch's memory far down (the H200 LM head: 0.18 MB per token against 1.2 MB measured at
    the largest shapes), on absolute bytes it follows the large shapes, where memory binds."""
    if target.startswith(TRANSIENT):
        return functools.partial(NonNegativeLinearRegression, relative=False)
    return NonNegativeLinearRegression


def _measured_optional_targets(shapes: pd.DataFrame, module: str, tp) -> tuple[str, ...]:
    """The optional targets every shape of this (module, tp) has; a partly measured one is left out
    (with a warning), since a fit on some shapes would extrapolate silently."""
    present = []
    for target in OPTIONAL_TARGETS:
        if target not in shapes.columns:
            continue
        measured = shapes[target].notna()
        if measured.all():
            present.append(target)
        elif measured.any():
            log.warning("%s at tp=%s: %s measured on %d of %d shapes; not fitted", module, tp, target,
                        int(measured.sum()), len(shapes))
    return tuple(present)


def format_validation(validation: pd.DataFrame) -> str:
    """A fixed-width table of held-out errors (percent) for logs and benchmarks."""
    lines = [f"{'module':<14} {'tp':>3} {'target':<19} {'shapes':>6} {'median%':>8} {'p90%':>8} {'max%':>8}"]
    for r in validation.itertuples(index=False):
        lines.append(
            f"{r.module:<14} {r.tp:>3} {r.target:<19} {r.n_test_shapes:>6} "
            f"{r.mape_median:>8.2f} {r.mape_p90:>8.2f} {r.mape_max:>8.2f}"
        )
    return "\n".join(lines)


def _dflop_version() -> str:
    try:
        return version("dflop")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
