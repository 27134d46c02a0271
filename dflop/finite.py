"""The one check every artifact reader runs on numbers: finite, of a numeric type, in range.

Python's ``json`` accepts ``NaN`` and ``Infinity`` (and turns ``1e999`` into inf), YAML has
``.nan`` and ``.inf``, a Parquet column can hold them or hold strings, and a schema's
``minimum: 0`` or a ``x > limit`` test is silently false for NaN. So a garbage number would flow
through the planner into a printed "step nan" or a "fitting" NaN memory. dflop never writes such
values (its JSON is written with ``allow_nan=False``), so a reader refuses them, in one line naming
the file and the key, or the column and the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from dflop.errors import UserError


def _nonfinite(data: Any, path: str) -> tuple[str, float] | None:
    """(key path, value) of the first NaN or infinite float in a parsed document, depth first."""
    if isinstance(data, float):  # numpy floats subclass float; bools and ints are always finite
        return None if math.isfinite(data) else (path, data)
    if isinstance(data, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in data.items())
    elif isinstance(data, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(data))
    else:
        return None
    for where, value in items:
        found = _nonfinite(value, where)
        if found is not None:
            return found
    return None


def check_finite_document(data: Any, source: str) -> None:
    """One-line UserError naming `source` and the key (``modules[2].coef.fwd_ms[0]``) of the first
    NaN or infinite number anywhere in a parsed JSON or YAML document."""
    found = _nonfinite(data, "")
    if found is not None:
        where, value = found
        raise UserError(f"{source}: {where or 'top level'}: {value} is not a finite number")


@dataclass(frozen=True)
class Numbers:
    """What one numeric column of a table must hold.

    minimum: the smallest value allowed (None: any finite value).
    whole: only whole numbers (counts, sizes).
    missing_ok: NaN means "not measured" and is allowed (infinities are not).
    above: values must be above `minimum`, not equal to it (a duration that divides).
    """

    minimum: float | None = 0
    whole: bool = False
    missing_ok: bool = False
    above: bool = False

    def describe(self) -> str:
        kind = "a whole number" if self.whole else "a finite number"
        return kind if self.minimum is None else f"{kind} {'>' if self.above else '>='} {self.minimum:g}"


def check_columns(table: pd.DataFrame, source: str, columns: dict[str, Numbers],
                  row_name: Callable[[int], str] | None = None) -> None:
    """One-line UserError unless each of `columns` the table has is numeric (not strings, not
    booleans) and each value meets its `Numbers`; the message names `source`, the column and the
    first bad row (`row_name(i)` of its position, default "row i"). Absent columns are the
    caller's business (required or optional)."""
    name = row_name or (lambda i: f"row {i}")
    for column, rule in columns.items():
        if column not in table.columns:
            continue
        values = table[column]
        if not pd.api.types.is_numeric_dtype(values.dtype) or pd.api.types.is_bool_dtype(values.dtype):
            first = f" ({name(0)}: {_show(values.iloc[0])})" if len(values) else ""
            raise UserError(f"{source}: column {column} holds {values.dtype} values, expected numbers{first}")
        numbers = values.to_numpy(dtype=np.float64, na_value=np.nan)
        bad = ~np.isfinite(numbers)
        if rule.missing_ok:
            bad &= ~np.isnan(numbers)
        with np.errstate(invalid="ignore"):
            if rule.minimum is not None:
                bad |= (numbers <= rule.minimum) if rule.above else (numbers < rule.minimum)
            if rule.whole:
                bad |= np.isfinite(numbers) & (numbers != np.round(numbers))
        if bad.any():
            first = np.flatnonzero(bad)
            more = f"; {len(first)} bad rows" if len(first) > 1 else ""
            raise UserError(f"{source}: {name(int(first[0]))} has invalid {column}={_show(values.iloc[first[0]])} "
                            f"(must be {rule.describe()}{more})")


def check_finite_values(values: Iterable[tuple[str, Any]], source: str, *, positive: bool = False) -> None:
    """One-line UserError naming `source` and the key of the first value that is not a finite
    number (or not > 0 with `positive`): for a few scalars read out of a document."""
    for key, value in values:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (positive and value <= 0):
            raise UserError(f"{source}: {key} is {value!r}, expected a finite number{' > 0' if positive else ''}")


def _show(value: Any) -> str:
    """A cell as the message shows it: numbers bare (nan, inf, 3), anything else repr'd."""
    if hasattr(value, "item"):
        value = value.item()
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
