"""The machines a plan is for, and the communication times every pricing of a plan charges.

Rank layout (what plan.yaml's topology describes): the vision ranks come first, then the LLM ranks
(in the colocated placement the vision tower runs on the LLM's first-stage ranks). Inside a module
``rank = first_rank + (stage * dp + replica) * tp + tp_rank``: tensor-parallel ranks are adjacent
(TP never leaves a node, since tp divides gpus_per_node), then data-parallel replicas, then stages.

Communication model (bandwidths from the `cluster` config section; every function here works on
numpy arrays as well as scalars, so the search can use it on many layouts at once):
- a pipeline hop inside a module uses the intra-node bandwidth when all of that module's ranks
  sit in one node, otherwise the inter-node bandwidth (conservative: one slow hop slows them all);
- the vision -> LLM hop (disjoint placement) is intra-node only when both modules fit in one node;
- the gradient all-reduce of a stage is a ring over its dp replicas:
  ``2 (dp - 1) / dp * bytes / bandwidth + 2 (dp - 1) * latency`` seconds, intra-node when every
  stage's replica block is aligned inside a node, 0 when dp = 1.
Transfers are charged as time the receiving stage cannot compute (no overlap), which is
conservative for large messages and exact for latency-bound ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from dflop.config import ClusterSection
from dflop.costmodel.model import BytesLine
from dflop.errors import UserError

GB = 1e9  # config sizes and bandwidths are decimal gigabytes


@dataclass(frozen=True)
class Cluster:
    """nodes x gpus_per_node GPUs (on CPU: processes) with `gpu_memory_bytes` each.

    Bandwidths in bytes/s; latency in seconds (one pipeline send or one all-reduce ring step).
    """

    nodes: int = 1
    gpus_per_node: int = 2
    gpu_memory_bytes: float = 8 * GB
    intra_node_bytes_per_s: float = 150 * GB
    inter_node_bytes_per_s: float = 25 * GB
    p2p_latency_s: float = 20e-6
    device: str = "cpu"

    def __post_init__(self):
        for key, value, minimum in (("nodes", self.nodes, 1), ("gpus_per_node", self.gpus_per_node, 1)):
            if int(value) != value or value < minimum:
                raise UserError(f"cluster.{key} must be a whole number >= {minimum}, got {value!r}")
        for key in ("gpu_memory_bytes", "intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            if not getattr(self, key) > 0:
                raise UserError(f"cluster.{key} must be > 0, got {getattr(self, key)!r}")
        if not self.p2p_latency_s >= 0:
            raise UserError(f"cluster.p2p_latency_s must be >= 0, got {self.p2p_latency_s!r}")

    @classmethod
    def from_section(cls, section: ClusterSection) -> "Cluster":
        """The cluster of the config's ``cluster`` section (GB, GB/s, microseconds)."""
        return cls(nodes=int(section.nodes), gpus_per_node=int(section.gpus_per_node),
                   gpu_memory_bytes=section.gpu_memory_gb * GB, intra_node_bytes_per_s=section.intra_node_gbps * GB,
                   inter_node_bytes_per_s=section.inter_node_gbps * GB, p2p_latency_s=section.p2p_latency_us * 1e-6,
                   device=section.device)

    @classmethod
    def from_record(cls, record, where: str) -> "Cluster":
        """The cluster a plan.yaml records (``to_config``'s keys); one-line UserError naming the key."""
        if not isinstance(record, dict):
            raise UserError(f"{where}: cluster: expected a mapping of cluster keys")
        names = [f.name for f in fields(ClusterSection)]
        missing = [k for k in names if k not in record]
        if missing:
            raise UserError(f"{where}: cluster: missing key(s) {', '.join(missing)}")
        for key in names:
            if key == "device":
                continue
            positive = key != "p2p_latency_us"  # a zero-GB GPU or a zero-bandwidth link prices nothing sensibly
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 if positive else value >= 0):
                raise UserError(f"{where}: cluster.{key} must be a number {'>' if positive else '>='} 0, got {value!r}")
        return cls.from_section(ClusterSection(**{k: record[k] for k in names}))

    def to_config(self) -> dict:
        """The inverse of `from_section` (config units), for plan.yaml."""
        return {"device": self.device, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "gpu_memory_gb": self.gpu_memory_bytes / GB, "intra_node_gbps": self.intra_node_bytes_per_s / GB,
                "inter_node_gbps": self.inter_node_bytes_per_s / GB, "p2p_latency_us": self.p2p_latency_s * 1e6}

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_gpus(self, gpus: int) -> "Cluster":
        """The same kind of machines, `gpus` of them (whole nodes when gpus > gpus_per_node)."""
        if gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {gpus}")
        if gpus <= self.gpus_per_node:
            return Cluster(1, gpus, self.gpu_memory_bytes, self.intra_node_bytes_per_s,
                           self.inter_node_bytes_per_s, self.p2p_latency_s, self.device)
        if gpus % self.gpus_per_node:
            raise UserError(f"--gpus {gpus} is not a whole number of {self.gpus_per_node}-GPU nodes")
        return Cluster(gpus // self.gpus_per_node, self.gpus_per_node, self.gpu_memory_bytes,
                       self.intra_node_bytes_per_s, self.inter_node_bytes_per_s, self.p2p_latency_s, self.device)

    def check_runs(self, layout, where: str) -> None:
        """One-line UserError unless `layout` (a `dflop.plan.Layout`) fits this cluster and the
        launcher can start it (`launchable`); `where` names the plan in the message."""
        if layout.world_size > self.world_size:
            raise UserError(f"{where}: the plan needs {layout.world_size} GPUs but the cluster has {self.world_size} "
                            f"({self.nodes} node(s) x {self.gpus_per_node})")
        if not bool(self.launchable(layout.world_size, layout.vision_gpus, layout.tp_l)):
            raise UserError(f"{where}: {layout.describe()} cannot be launched on {self.gpus_per_node}-GPU nodes: the "
                            f"{layout.world_size} ranks must fill one node or whole nodes, and the "
                            f"{layout.vision_gpus} vision ranks must be a multiple of llm tp={layout.tp_l} so no "
                            "LLM TP group spans two nodes")

    # ---- communication (array-friendly) --------------------------------------------------------

    def launchable(self, world, vision_ranks, tp_l):
        """True where a layout of `world` ranks can be started as planned.

        torchrun starts the same number of ranks on every node, so the world is part of one node
        or whole nodes; and the LLM ranks follow the `vision_ranks` vision ranks (0 when
        colocated), so that offset must be a multiple of the LLM's TP degree for every LLM TP group
        to sit in one node.
        """
        world = np.asarray(world)
        g = self.gpus_per_node
        return ((world <= g) | (world % g == 0)) & (np.asarray(vision_ranks) % np.asarray(tp_l) == 0)

    def launchable_dps(self, per_replica: int, dp_max: int, tp: int) -> np.ndarray:
        """Replica counts <= dp_max of a colocated layout (`per_replica` GPUs each, TP `tp`) that
        `launchable` allows, largest first."""
        dps = np.arange(max(dp_max, 0), 0, -1)
        return dps[self.launchable(dps * per_replica, 0, tp)]

    def largest_launchable_vision_dp(self, dp_max, per_vision: int, llm_ranks, tp_l) -> np.ndarray:
        """Per disjoint layout, the largest vision dp <= dp_max that `launchable` allows (0: none),
        the LLM side holding `llm_ranks` ranks of TP `tp_l` after the vision ranks.

        Whole-node layouts: the conditions on dp are congruences modulo divisors of
        gpus_per_node, so their solutions repeat every gpus_per_node values and the largest lies in
        the top window of that many. One-node layouts: the largest dp that keeps the world inside
        one node.
        """
        dp_max, llm_ranks, tp_l = np.asarray(dp_max), np.asarray(llm_ranks), np.asarray(tp_l)
        g = self.gpus_per_node
        best = np.zeros_like(dp_max)
        for k in range(g):  # the top window, largest first
            d = dp_max - k
            pick = (best == 0) & (d >= 1) & self.launchable(d * per_vision + llm_ranks, d * per_vision, tp_l)
            best[pick] = d[pick]
        step = tp_l // np.gcd(per_vision, tp_l)  # dp a multiple of this keeps vision ranks % tp_l == 0
        in_node = np.minimum(dp_max, (g - llm_ranks) // per_vision) // step * step
        return np.maximum(best, np.maximum(in_node, 0))

    def in_one_node(self, first_rank, n_ranks):
        """True where ranks [first_rank, first_rank + n_ranks) all sit in one node."""
        g = self.gpus_per_node
        first = np.asarray(first_rank)
        return (first // g) == ((first + np.asarray(n_ranks) - 1) // g)

    def bandwidth(self, intra):
        """Bytes/s of a link: intra-node where `intra` is true, else inter-node."""
        return np.where(intra, self.intra_node_bytes_per_s, self.inter_node_bytes_per_s)

    def dp_group_intra(self, first_rank, tp, pp, dp):
        """True where every stage's dp x tp block of a module lies inside one node."""
        block = np.asarray(tp) * np.asarray(dp)
        g = self.gpus_per_node
        aligned = (block <= g) & (g % block == 0) & (np.asarray(first_rank) % block == 0)
        return aligned | self.in_one_node(first_rank, block * np.asarray(pp))

    def reduce_scatter_s(self, nbytes, dp, intra):
        """Seconds of a ring reduce-scatter of `nbytes` over `dp` replicas, or of a ring all-gather
        of them (the same traffic): half an all-reduce (0 when dp == 1)."""
        dp = np.asarray(dp, dtype=np.float64)
        ring = (dp - 1.0) / dp * np.asarray(nbytes) / self.bandwidth(intra)
        return np.where(dp > 1, ring + (dp - 1.0) * self.p2p_latency_s, 0.0)

    def allreduce_s(self, grad_bytes, dp, intra):
        """Seconds of a ring all-reduce of `grad_bytes` over `dp` replicas (0 when dp == 1)."""
        dp = np.asarray(dp, dtype=np.float64)
        ring = 2.0 * (dp - 1.0) / dp * np.asarray(grad_bytes) / self.bandwidth(intra)
        return np.where(dp > 1, ring + 2.0 * (dp - 1.0) * self.p2p_latency_s, 0.0)


@dataclass(frozen=True)
class Links:
    """Link bandwidths (bytes/s), pipeline send latency (s) and all-reduce placement of layouts
    (arrays broadcast)."""

    vision_to_llm_bps: np.ndarray
    llm_hop_bps: np.ndarray
    vision_hop_bps: np.ndarray
    vision_allreduce_intra: np.ndarray
    llm_allreduce_intra: np.ndarray
    p2p_latency_s: np.ndarray | float = 0.0


def links(cluster: Cluster, *, colocated, tp_v, pp_v, dp_v, tp_l, pp_l, dp_l,
          p2p: BytesLine | None = None) -> Links:
    """Which links the layout's transfers and all-reduces use (rank layout: this module's docstring).

    p2p: a measured pipeline message (`StepCosts.p2p`, already gated to the cluster's kind of
    device): where the whole layout sits in one node, where it was measured, its per-byte cost is
    every hop's bandwidth and its constant the send latency; elsewhere the cluster's numbers."""
    n_vision = np.where(colocated, 0, np.asarray(tp_v) * pp_v * dp_v)
    n_llm = np.asarray(tp_l) * pp_l * dp_l
    found = Links(
        vision_to_llm_bps=cluster.bandwidth(cluster.in_one_node(0, n_vision + n_llm)),
        llm_hop_bps=cluster.bandwidth(cluster.in_one_node(n_vision, n_llm)),
        vision_hop_bps=cluster.bandwidth(cluster.in_one_node(0, np.maximum(n_vision, 1))),
        vision_allreduce_intra=cluster.dp_group_intra(0, tp_v, pp_v, dp_v),
        llm_allreduce_intra=cluster.dp_group_intra(n_vision, tp_l, pp_l, dp_l),
        p2p_latency_s=cluster.p2p_latency_s,
    )
    if p2p is None or p2p.per_byte_s <= 0:
        return found
    one_node = cluster.in_one_node(0, n_vision + n_llm)
    measured_bps = 1.0 / p2p.per_byte_s
    return Links(*(np.where(one_node, measured_bps, bps) for bps in
                   (found.vision_to_llm_bps, found.llm_hop_bps, found.vision_hop_bps)),
                 found.vision_allreduce_intra, found.llm_allreduce_intra,
                 np.where(one_node, p2p.const_s, cluster.p2p_latency_s))
