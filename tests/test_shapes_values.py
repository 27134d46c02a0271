"""shapes.parquet's numbers: a non-finite size or a column of strings is one line naming the file,
the column and the sample, not a NaN priced into every plan."""

import numpy as np
import pandas as pd
import pytest

from dflop.errors import UserError
from dflop.shapes import read_shapes


def _shapes(n=4) -> pd.DataFrame:
    return pd.DataFrame({
        "sample_id": [f"s{i}" for i in range(n)], "dataset": "d", "modality": "image",
        "n_images": np.ones(n, np.int32), "n_frames": np.zeros(n, np.int32), "n_tiles": np.full(n, 2, np.int32),
        "vision_tokens": np.full(n, 128), "text_tokens": np.full(n, 30), "seq_len": np.full(n, 158),
        "media_pixels": np.full(n, 4096), "status": "ok",
    })


@pytest.mark.parametrize("column,value,shown", [
    ("n_tiles", np.inf, "inf"), ("seq_len", np.inf, "inf"), ("text_tokens", np.nan, "nan"),
    ("n_frames", -np.inf, "-inf"), ("media_pixels", np.inf, "inf"), ("n_images", -1, "-1"),
])
def test_non_finite_and_negative_sizes_name_the_sample(tmp_path, column, value, shown):
    table = _shapes()
    table[column] = table[column].astype(np.float64) if isinstance(value, float) else table[column]
    table.loc[2, column] = value
    table.to_parquet(tmp_path / "shapes.parquet")
    least = 1 if column == "seq_len" else 0
    with pytest.raises(UserError, match=rf"^\S*shapes\.parquet: sample 's2' has invalid {column}={shown} "
                                        rf"\(must be a whole number >= {least}\)$"):
        read_shapes(tmp_path / "shapes.parquet")


def test_a_column_of_strings_is_refused(tmp_path):
    table = _shapes()
    table["seq_len"] = table["seq_len"].astype(str)  # "158": to_numeric used to take it
    table.to_parquet(tmp_path / "shapes.parquet")
    with pytest.raises(UserError, match=r"^\S*shapes\.parquet: column seq_len holds \S+ values, expected numbers "
                                        r"\(sample 's0': '158'\)$"):
        read_shapes(tmp_path / "shapes.parquet")
