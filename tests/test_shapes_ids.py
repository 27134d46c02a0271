"""shapes.parquet ids: `read_shapes` refuses a (dataset, sample_id) on two rows."""

import pandas as pd
import pytest

from dflop.errors import UserError
from dflop.shapes import SHAPE_COLUMNS, read_shapes


def _row(dataset: str, sample_id: str, status: str = "ok") -> dict:
    row = dict.fromkeys(SHAPE_COLUMNS, 1)
    return {**row, "dataset": dataset, "sample_id": sample_id, "modality": "text", "status": status}


@pytest.mark.parametrize("status", ["ok", "skipped:missing_file"])
def test_a_sample_on_two_rows_is_refused_naming_it(tmp_path, status):
    # The second copy may be a skipped row: the trainer would still map the ok one by id alone.
    rows = [_row("d", "x"), _row("d", "a"), _row("e", "a"), _row("d", "a", status)]
    pd.DataFrame(rows).to_parquet(tmp_path / "shapes.parquet")
    with pytest.raises(UserError, match=rf"^{tmp_path}/shapes.parquet: sample d/a is on rows 1 and 3; each "
                                        r"\(dataset, sample_id\) must be on one row \(re-run profile_data\)$"):
        read_shapes(tmp_path / "shapes.parquet")


def test_one_id_in_two_datasets_is_two_samples(tmp_path):
    pd.DataFrame([_row("d", "a"), _row("e", "a")]).to_parquet(tmp_path / "shapes.parquet")
    assert list(read_shapes(tmp_path / "shapes.parquet")["dataset"]) == ["d", "e"]
