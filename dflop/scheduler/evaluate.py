"""Stage times of an assignment, its simulated 1F1B step, the fast proxy, and the lower bound.

Under interleaved 1F1B (`BatchCosts.llm_chunks`) the LLM rows are pipeline ranks (what the
partitioners balance) and the simulations time the chunks with the simulator's interleaved
schedule (`simulate_times`, `simulate_steps`); the lower bound stays the ranks' 1F1B one.

Model (DESIGN §5): the global batch is split into ``m`` microbatches x ``dp_llm`` bins. Bin
``b = j * dp_llm + r`` is microbatch ``j`` on LLM replica ``r``. On LLM stage ``k`` the bin's time is
``llm_const[k] + sum of its samples' costs`` (packed, attention does not cross samples). On vision
stage ``k`` microbatch ``j`` takes ``vision_const[k] + (sum over all its bins' samples) / dp_vision``:
the runtime deals the microbatch's tiles over the vision replicas by cost, which is even to within
one tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.sim import SimResult, simulate, simulate_dp, simulate_dp_steps


@dataclass(frozen=True)
class StageTimes:
    """Forward/backward seconds of every microbatch on every stage, by microbatch id.

    vision_fwd, vision_bwd: [pp_v, m]; llm_fwd, llm_bwd: [dp_llm, pp_l, m].
    llm_chunk_fwd, llm_chunk_bwd: under interleaved 1F1B [dp_llm, pp_l * chunks, m] per model
    chunk (what is simulated), else None.
    """

    vision_fwd: np.ndarray
    vision_bwd: np.ndarray
    llm_fwd: np.ndarray
    llm_bwd: np.ndarray
    llm_chunk_fwd: np.ndarray | None = None
    llm_chunk_bwd: np.ndarray | None = None
    chunks: int = 1

    def simulated(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """(LLM forward, LLM backward, schedule keywords) the simulation runs: the chunks under
        interleaving, else the stages under 1F1B."""
        if self.llm_chunk_fwd is None:
            return self.llm_fwd, self.llm_bwd, {}
        return self.llm_chunk_fwd, self.llm_chunk_bwd, {"schedule": "interleaved", "chunks": self.chunks}

    def chunk_allreduce(self, allreduce_s) -> np.ndarray | float:
        """`allreduce_s` ([vision stages + pp_l], or a scalar) per simulated row: under
        interleaving each chunk pays its rank's tail (the rank's last backward ends it)."""
        if self.llm_chunk_fwd is None or np.ndim(allreduce_s) == 0:
            return allreduce_s
        n_v, pp = self.vision_fwd.shape[0], self.llm_fwd.shape[1]
        tails = np.asarray(allreduce_s, dtype=np.float64)
        return np.concatenate([tails[:n_v], tails[n_v:][np.arange(pp * self.chunks) % pp]])

    def microbatch_weight(self) -> np.ndarray:
        """[m] seconds of each microbatch on its busiest stage and replica (forward + backward)."""
        vis = (self.vision_fwd + self.vision_bwd).max(axis=0, initial=0.0)
        llm = (self.llm_fwd + self.llm_bwd).max(axis=(0, 1))
        return np.maximum(vis, llm)


def stage_times(costs: BatchCosts, microbatch: np.ndarray, replica: np.ndarray, m: int,
                dp_llm: int, dp_vision: int) -> StageTimes:
    """Stage times of the assignment sample ``i`` -> (microbatch[i], replica[i])."""
    bins = microbatch * dp_llm + replica
    n_bins = m * dp_llm

    def per_bin(x: np.ndarray) -> np.ndarray:  # [S, n] -> [dp, S, m]
        out = np.stack([np.bincount(bins, weights=row, minlength=n_bins) for row in x])
        return out.reshape(x.shape[0], m, dp_llm).transpose(2, 0, 1)

    def per_mb(x: np.ndarray) -> np.ndarray:  # [S, n] -> [S, m]
        if x.shape[0] == 0:
            return np.zeros((0, m))
        return np.stack([np.bincount(microbatch, weights=row, minlength=m) for row in x]) / dp_vision

    chunks = costs.llm_chunks
    return StageTimes(
        vision_fwd=per_mb(costs.vision_fwd) + costs.vision_fwd_const[:, None],
        vision_bwd=per_mb(costs.vision_bwd) + costs.vision_bwd_const[:, None],
        llm_fwd=per_bin(costs.llm_fwd) + costs.llm_fwd_const[None, :, None],
        llm_bwd=per_bin(costs.llm_bwd) + costs.llm_bwd_const[None, :, None],
        llm_chunk_fwd=None if chunks is None else per_bin(chunks.fwd) + chunks.fwd_const[None, :, None],
        llm_chunk_bwd=None if chunks is None else per_bin(chunks.bwd) + chunks.bwd_const[None, :, None],
        chunks=1 if chunks is None else chunks.chunks,
    )


def simulate_times(times: StageTimes, order=None, *, p2p_s: float = 0.0, allreduce_s=0.0, schedule: str = "1f1b",
                   wgrad_frac=0.5) -> SimResult:
    """The exact step of these stage times (vision stages coupled to every LLM replica) under the
    LLM's pipeline `schedule` (`dflop.sim.simulate_dp`; ZB-H1 with the W share `wgrad_frac`):
    interleaved 1F1B of the chunks wherever the times carry them (an interleaved plan's pricing)."""
    llm_fwd, llm_bwd, chunked = times.simulated()
    return simulate_dp(times.vision_fwd, times.vision_bwd, llm_fwd, llm_bwd, order=order, p2p_s=p2p_s,
                       allreduce_s=times.chunk_allreduce(allreduce_s), wgrad_frac=wgrad_frac,
                       **(chunked or {"schedule": schedule}))


def simulate_steps(times: list[StageTimes], orders: list[np.ndarray], *, p2p_s: float = 0.0,
                   allreduce_s=0.0) -> np.ndarray:
    """[C] exact 1F1B step seconds of ``times[c]`` run in ``orders[c]``, in one pass (equal to
    `simulate_times` of each, bit for bit; all candidates must share the layout)."""
    llm = [t.simulated() for t in times]
    return simulate_dp_steps(np.stack([t.vision_fwd for t in times]), np.stack([t.vision_bwd for t in times]),
                             np.stack([f for f, _, _ in llm]), np.stack([b for _, b, _ in llm]),
                             np.stack(orders), p2p_s=p2p_s, allreduce_s=times[0].chunk_allreduce(allreduce_s),
                             **llm[0][2])


def memory_ok(costs: BatchCosts, microbatch: np.ndarray, replica: np.ndarray, m: int, dp_llm: int,
              dp_vision: int) -> bool:
    """True when no bin (LLM) and no microbatch share (vision) exceeds its stage's memory limit
    (`BatchCosts.llm_mem_bytes`: activations and transients)."""
    bins = microbatch * dp_llm + replica
    for k in range(costs.pp_llm):
        if np.bincount(bins, weights=costs.llm_mem_bytes[k], minlength=m * dp_llm).max() > costs.llm_mem_limit_bytes[k]:
            return False
    for k in range(costs.pp_vision):
        if np.bincount(microbatch, weights=costs.vision_mem_bytes[k], minlength=m).max() / dp_vision > costs.vision_mem_limit_bytes[k]:
            return False
    return True


@dataclass(frozen=True)
class ScalarCosts:
    """Each sample's cost on the bottleneck stage of each module, in stage-seconds (fwd + bwd).

    The greedy and local search balance these two numbers per sample; the final choice is made
    on the exact simulation. Exact when a module's per-sample costs are proportional across its
    stages (a layer split), an approximation otherwise.

    vision: [n] seconds on the busiest vision stage, already divided by dp_vision (0 if no vision
    stage); llm: [n]; vision_const, llm_const: per-microbatch / per-bin overhead on those stages.
    """

    vision: np.ndarray
    llm: np.ndarray
    vision_const: float
    llm_const: float


def scalar_costs(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int) -> ScalarCosts:
    llm_stage = costs.llm_fwd + costs.llm_bwd
    llm_const = costs.llm_fwd_const + costs.llm_bwd_const
    k = int(np.argmax(llm_stage.sum(axis=1) + m * dp_llm * llm_const))
    if costs.pp_vision:
        vis_stage = costs.vision_fwd + costs.vision_bwd
        vis_const = costs.vision_fwd_const + costs.vision_bwd_const
        kv = int(np.argmax(vis_stage.sum(axis=1) / dp_vision + m * vis_const))
        vision, vconst = vis_stage[kv] / dp_vision, float(vis_const[kv])
    else:
        vision, vconst = np.zeros(costs.n_samples), 0.0
    return ScalarCosts(vision=vision, llm=llm_stage[k], vision_const=vconst, llm_const=float(llm_const[k]))


def equal_split_step(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, *, p2p_s: float = 0.0,
                     allreduce_s=0.0) -> float:
    """T*: the 1F1B step if every microbatch (and bin) carried exactly 1/m (1/(m dp)) of the work.

    With stages of equal work this is the closed form (m + p - 1)/m * W/(d p) of DESIGN §7; with
    unequal stages it is the same idea, simulated on the given stages.
    """
    vf = costs.vision_fwd_const + costs.vision_fwd.sum(axis=1) / (dp_vision * m)
    vb = costs.vision_bwd_const + costs.vision_bwd.sum(axis=1) / (dp_vision * m)
    lf = costs.llm_fwd_const + costs.llm_fwd.sum(axis=1) / (dp_llm * m)
    lb = costs.llm_bwd_const + costs.llm_bwd.sum(axis=1) / (dp_llm * m)
    fwd = np.repeat(np.concatenate([vf, lf])[:, None], m, axis=1)
    bwd = np.repeat(np.concatenate([vb, lb])[:, None], m, axis=1)
    return simulate(fwd, bwd, p2p_s=p2p_s, allreduce_s=allreduce_s).step_s


def heaviest_sample_path(costs: BatchCosts, dp_vision: int, *, p2p_s: float = 0.0) -> float:
    """Seconds the heaviest single sample needs alone: forward down every stage and backward up.

    Any step is at least this long, whatever the partition (its microbatch's constants included).
    """
    per_sample = ((costs.vision_fwd + costs.vision_bwd).sum(axis=0) / dp_vision
                  + (costs.llm_fwd + costs.llm_bwd).sum(axis=0))
    const = (costs.vision_fwd_const + costs.vision_bwd_const).sum() + (costs.llm_fwd_const + costs.llm_bwd_const).sum()
    p = costs.pp_vision + costs.pp_llm
    return float(per_sample.max(initial=0.0) + const + 2 * (p - 1) * p2p_s)


def lower_bound(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, *, p2p_s: float = 0.0,
                allreduce_s=0.0) -> float:
    """The benchmark's bound: max(T*, heaviest sample's critical path + stage 0's all-reduce)."""
    p = costs.pp_vision + costs.pp_llm
    tail = float(np.broadcast_to(np.asarray(allreduce_s, dtype=np.float64), (p,))[0])
    return max(equal_split_step(costs, m, dp_llm, dp_vision, p2p_s=p2p_s, allreduce_s=allreduce_s),
               heaviest_sample_path(costs, dp_vision, p2p_s=p2p_s) + tail)
