import numpy as np
import pytest

from dflop.costmodel.types import BatchCosts
from dflop.scheduler.evaluate import equal_split_step, heaviest_sample_path, lower_bound, stage_times


def _random_costs(rng, n, pp_v, pp_l):
    vf = rng.uniform(0, 1, (pp_v, n)) * (rng.uniform(size=n) > 0.2)
    lf = rng.uniform(0.1, 1, (pp_l, n))
    inf = lambda k: np.full(k, np.inf)  # noqa: E731
    return BatchCosts(vf, 2 * vf, lf, 2 * lf, rng.uniform(0, 0.1, pp_v), rng.uniform(0, 0.1, pp_v),
                      rng.uniform(0, 0.1, pp_l), rng.uniform(0, 0.1, pp_l), np.ones((pp_l, n)), np.ones((pp_v, n)),
                      inf(pp_l), inf(pp_v))


def test_stage_times_match_explicit_sums():
    rng = np.random.default_rng(0)
    n, m, dp, dpv = 30, 3, 2, 3
    c = _random_costs(rng, n, 2, 3)
    mb, rep = rng.integers(0, m, n), rng.integers(0, dp, n)
    st = stage_times(c, mb, rep, m, dp, dpv)
    for j in range(m):
        for k in range(2):
            want = c.vision_fwd_const[k] + sum(c.vision_fwd[k, i] for i in range(n) if mb[i] == j) / dpv
            assert st.vision_fwd[k, j] == pytest.approx(want)
        for r in range(dp):
            for k in range(3):
                want = c.llm_bwd_const[k] + sum(c.llm_bwd[k, i] for i in range(n) if mb[i] == j and rep[i] == r)
                assert st.llm_bwd[r, k, j] == pytest.approx(want)


def test_equal_split_is_design_closed_form_when_stages_balanced():
    # Every stage (1 vision + 3 LLM) carries the same work W/(d p): T* = (m + p - 1)/m * W/(d p).
    n, m, d, p = 40, 8, 2, 4
    per = np.full(n, 0.3)
    zero = np.zeros(1)
    c = BatchCosts(per[None], 2 * per[None], np.tile(per, (3, 1)), np.tile(2 * per, (3, 1)),
                   zero, zero, np.zeros(3), np.zeros(3), np.ones((3, n)), np.ones((1, n)),
                   np.full(3, np.inf), np.full(1, np.inf))
    work = 4 * 3 * per.sum()  # GPU-seconds: each of the p stages does 3*sum(per) over its d replicas
    assert equal_split_step(c, m, d, d) == pytest.approx((m + p - 1) / m * work / (d * p))


def test_heaviest_sample_path_and_bound():
    rng = np.random.default_rng(1)
    c = _random_costs(rng, 10, 1, 2)
    i = int(np.argmax(c.vision_total() / 2 + c.llm_total()))
    want = (c.vision_total()[i] / 2 + c.llm_total()[i] + c.vision_fwd_const.sum() + c.vision_bwd_const.sum()
            + c.llm_fwd_const.sum() + c.llm_bwd_const.sum())
    assert heaviest_sample_path(c, 2) == pytest.approx(want)
    assert lower_bound(c, 2, 1, 2) == pytest.approx(max(want, equal_split_step(c, 2, 1, 2)))
