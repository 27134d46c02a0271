"""candidates.parquet's group rows against rows written out by hand (`candidates.group_rows`)."""

import pandas as pd

from dflop.planner.candidates import COLUMNS, candidates_frame


def _groups():
    # one group per case: (n_fit, llm_fits, vision_fits) and a colocated group without a fitting dp split
    cases = [(0, False, False), (0, False, True), (0, True, False), (0, True, True), (3, True, True)]
    return pd.DataFrame({
        "colocated": [False, False, False, False, True], "tp_v": [1, 2, 1, 1, 4], "pp_v": [1, 1, 2, 1, 1],
        "dp_v": [3, 2, 0, 1, 2], "tp_l": [2, 2, 4, 8, 4], "pp_l": [2, 1, 1, 2, 1], "dp_l": [2, 1, 0, 1, 2],
        "m": [4, 2, 8, 1, 2], "n_fit": [c[0] for c in cases], "llm_fits": [c[1] for c in cases],
        "vision_fits": [c[2] for c in cases], "n_layouts": [5, 6, 7, 8, 9], "bound_s": [1.5, 2.5, 3.5, 4.5, 5.5]})


def test_group_rows_by_hand():
    df = candidates_frame([{"kind": "plan", "level": "layout", "status": "chosen", "tp_v": 1,
                            "vision_layers": (3,), "llm_recompute": ("none", "full")}], _groups())
    assert list(df.columns) == list(COLUMNS) and len(df) == 6
    g = df.iloc[1:]
    side = ["llm and vision stages", "llm stages", "vision stages", "vision stages"]
    assert g["detail"].tolist() == [f"no layer split fits in GPU memory on the {s} for any dp split" for s in side] + \
        ["lower bound above the plans kept"]
    assert g["status"].tolist() == ["rejected"] * 4 + ["pruned"]
    assert g["reason"].tolist() == ["memory"] * 4 + ["bound"]
    assert g["placement"].tolist() == ["disjoint"] * 4 + ["colocated"]
    # world = tp_v pp_v dp_v (disjoint) + tp_l pp_l dp_l; no dp split (dp_l 0): null
    assert g["world_size"].tolist() == [3 + 8, 4 + 2, pd.NA, 1 + 16, 8]
    assert g["dp_v"].tolist() == [3, 2, pd.NA, 1, 2]
    assert g["level"].tolist() == ["group"] * 5 and g["kind"].tolist() == ["plan"] * 5
    assert g["vision_layers"].tolist() == [None] * 5 and g["llm_recompute"].tolist() == [None] * 5
    assert df["vision_layers"].iloc[0] == [3] and df["llm_recompute"].iloc[0] == ["none", "full"]
    assert str(df["detail"].dtype) == "string" and str(df["dp_v"].dtype) == "Int64"
    assert str(df["shard_llm"].dtype) == "boolean" and df["bound_s"].dtype == "float64"
