"""benchmarks/synthetic_mix.py heavy_mix and for_architecture, and bench_planner.py --paper's inputs.

References are independent of the code under test: token counts from model_info's tokens per tile
by hand (LLaVA-OV video pooling) or from dflop.data.vision_tokens' processor-checked rules (InternVL).
"""

import math

import numpy as np
import pytest

from dflop.data.vision_tokens import internvl_video_shape
from dflop.errors import UserError
from dflop.models.info import model_info
from synthetic_mix import for_architecture, heavy_mix, llava_ov_mix

LLAVA = ("llava_ov", "siglip-so400m", "llama3-8b")
INTERNVL = ("internvl", "internvit-6b", "qwen2.5-72b")


@pytest.fixture(scope="module")
def heavy():
    return heavy_mix(5000, seed=11)


def test_heavy_mix_has_a_quarter_videos_of_8_to_64_frames(heavy):
    video = heavy[heavy.modality == "video"]
    assert abs(len(video) / len(heavy) - 0.25) <= 0.02
    frames = video.n_frames.to_numpy()
    assert frames.min() == 8 and frames.max() == 64  # ~1250 draws over 57 values reach both ends
    assert len(np.unique(frames)) == 57
    assert (video.n_tiles == video.n_frames).all()
    assert (heavy.loc[heavy.modality != "video", "n_frames"] == 0).all()


def test_llava_ov_video_tokens_follow_the_tokens_per_tile(heavy):
    # 729 = 27 x 27 features per frame, pooled 2x2 to ceil(27/2)^2, one newline per video
    side = math.isqrt(model_info(*LLAVA).llm_tokens_per_tile)
    per_frame = math.ceil(side / 2) ** 2
    shapes = for_architecture(heavy, "llava_ov", model_info(*LLAVA).llm_tokens_per_tile)
    video = shapes[shapes.modality == "video"].head(20)
    assert (video.seq_len == video.n_frames * per_frame + 1 + video.text_tokens).all()


def test_internvl_recount_matches_its_tokenisation(heavy):
    tpt = model_info(*INTERNVL).llm_tokens_per_tile
    assert tpt == 256
    shapes = for_architecture(heavy, "internvl", tpt)
    for kind in ("text", "image", "multi_image", "video"):
        for _, row in shapes[shapes.modality == kind].head(5).iterrows():
            if kind == "video":
                vision = internvl_video_shape(int(row.n_frames), tokens_per_tile=tpt).vision_tokens
            elif kind == "multi_image":  # one tile per image, <img></img> around each
                vision = int(row.n_images) * (tpt + 2)
            elif kind == "image":  # tiles + thumbnail, one <img></img>
                vision = int(row.n_tiles) * tpt + 2
            else:
                vision = 0
            assert row.vision_tokens == vision and row.seq_len == vision + row.text_tokens, (kind, row.sample_id)
    assert (shapes.n_tiles == heavy.n_tiles).all() and (shapes.text_tokens == heavy.text_tokens).all()


def test_for_architecture_refuses_what_it_cannot_recount():
    shapes = llava_ov_mix(10, seed=0)
    with pytest.raises(UserError, match="729 per tile"):
        for_architecture(shapes, "llava_ov", 576)
    with pytest.raises(UserError, match="n_frames"):
        for_architecture(shapes.drop(columns="n_frames"), "internvl", 256)


@pytest.fixture(scope="module")
def bench():
    import bench_planner  # benchmarks/ is on sys.path (tests/conftest.py)

    return bench_planner


def test_paper_shapes_file_errors_in_one_line(bench, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench_planner.py", "--paper", "--shapes", str(tmp_path / "none.parquet")])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    message = str(exc.value.code)
    assert "none.parquet" in message and "\n" not in message


def test_paper_pool_counts_tokens_per_architecture(bench, heavy):
    videos = heavy[heavy.modality == "video"].head(3)
    for preset, per_frame in ((LLAVA, 196), (INTERNVL, None)):
        pool = bench.paper_pool(videos.reset_index(drop=True), model_info(*preset), "test")
        frames = videos.n_frames.to_numpy()
        expected = (frames * per_frame + 1 if per_frame else
                    np.array([internvl_video_shape(int(f)).vision_tokens for f in frames]))
        assert (pool.vision_tokens == expected).all()
        assert (pool.seq_len == expected + videos.text_tokens.to_numpy()).all()


def test_internvit_pads_to_every_node_tp_degree(bench):
    """InternViT-6B's 25 heads pad with zero heads to 26 / 28 / 32 at TP 2 / 4 / 8 (NVLM's recipe), so
    inside an 8-GPU node every degree is admitted for the tower (and the colocated placement),
    named as padded in candidates; a fitted profile that lacks a degree still rejects it."""
    from dflop.costmodel.model import CostModel
    from dflop.pricing.cluster import GB, Cluster
    from dflop.planner.space import VISION_MODULES, ModelShape, build_space

    class Args:
        tflops, tp_gbps, no_gpu_profiles = 400.0, 300.0, False

    cost, source = bench.cost_model_for("qwen2.5-72b", Args, "internvl", "internvit-6b", profile="no-such-profile")
    assert source.startswith("analytic")
    cluster = Cluster(nodes=8, gpus_per_node=8, gpu_memory_bytes=80 * GB, intra_node_bytes_per_s=300 * GB,
                      inter_node_bytes_per_s=50 * GB, p2p_latency_s=20e-6, device="cuda")
    shape = ModelShape.from_info(model_info(*INTERNVL))
    kw = dict(placements=("disjoint", "colocated"), microbatches=range(1, 9), global_batch=64, mean_tiles=3.0)
    space, rows = build_space(shape, cost, cluster, **kw)
    assert list(space.vision_tp) == [1, 2, 4, 8] and list(space.llm_tp) == [1, 2, 4, 8]
    assert list(space.colocated_tp) == [1, 2, 4, 8]
    padded = {r["tp_v"]: r["detail"] for r in rows if r["reason"] == "vision_heads_padded"}
    assert all(r["status"] == "admitted" for r in rows if r["reason"] == "vision_heads_padded")
    assert sorted(padded) == [2, 4, 8] and "25 heads padded to 32" in padded[8] and "padded to 26" in padded[2]

    # a fitted profile measured the tower at TP 1 and 2 only: 4 and 8 are not profiled, as before
    fitted = CostModel([m for (name, t), m in cost.modules.items() if name not in VISION_MODULES or t <= 2],
                       cost.provenance)
    space, rows = build_space(shape, fitted, cluster, **kw)
    assert list(space.vision_tp) == [1, 2] and list(space.colocated_tp) == [1, 2]
    assert sorted(r["tp_v"] for r in rows if r["reason"] == "tp_not_profiled") == [4, 8]
