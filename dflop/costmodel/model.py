"""`CostModel`: fitted time and memory of pipeline stages, as used by the planner and scheduler.

A vision stage runs ``n_layers`` vision layers, plus the vision embeddings when it is the first
vision stage and the projector when it is the last. An LLM stage runs ``n_layers`` decoder layers on
one packed bin, plus the token embeddings when first and norm + head + loss when last.

Colocated placement (the whole vision tower on the first LLM stage) is the sum of the two:
``colocated_stage_time`` / ``colocated_stage_memory`` below, and ``batch_costs(..., colocated=True)``
folds the vision costs into LLM stage 0.

Units: times in seconds (the JSON stores the fitted milliseconds), memory in bytes, all per rank
at the given tensor-parallel degree.

Memory of a stage at its peak = training state (`dflop.costmodel.memory`) + in-flight microbatches x
the bytes saved for backward + the largest transient of the modules it runs on one microbatch: what
a module's forward + backward holds at its peak beyond what it saves (`TRANSIENT_TARGETS`; the LM
head's logits, their float32 copy and the loss's gradients; a recomputed layer's rerun forward). A
stage runs one module at a time, so a layer module's transient is one layer's, whatever the layer
count. A stage's ``recompute`` mode (none | selective | full) picks its layers'
``bwd_ms:<mode>`` / ``act_bytes:<mode>`` / ``transient_bytes:<mode>`` coefficients
(`RECOMPUTE_TARGETS`; the analytic model has them, `dflop.costmodel.activations` gives the bytes; a
model fitted on a profile that measured the modes has them too; without a mode's transient, the
mode's is mode none's plus the activations it no longer keeps, which its backward holds again). A
cost model without transients (fitted before the profiler measured them, from a profile without
CUDA peaks) prices them 0 (`jsonio.load_cost_model` says so). Not modelled: the allocator's
rounding and caching and a kernel's own scratch space, so keep a margin in the memory limit. Tied
input/output embeddings are counted on both the first and the last LLM stage, as pipelines
replicate them, and once on a stage that is both (``ModuleCosts.tied_param_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import numpy as np

from dflop.costmodel.features import (
    MODULE_FEATURES,
    ShapeKind,
    const_features,
    sample_features,
)
from dflop.costmodel.memory import canonical_dtype, training_state_bytes
from dflop.errors import UserError
from dflop.profiling.columns import RECOMPUTE_TARGETS, TRANSIENT_TARGETS

#: Fitted targets and their units; times are converted to seconds on prediction.
TARGETS = ("fwd_ms", "bwd_ms", "act_bytes")
#: Optional targets. Of layer modules under activation recomputation (plan key ``recompute``): the
#: backward including the recomputed forward, and the bytes kept for backward; absent, that mode
#: cannot be priced by this model (a profile from before the profiler measured the modes). Of any
#: module, its transient bytes (`TRANSIENT_TARGETS`, per mode for the layers); absent, 0.
OPTIONAL_TARGETS = (*(t for targets in RECOMPUTE_TARGETS.values() for t in targets), *TRANSIENT_TARGETS.values())
TRANSIENT = TRANSIENT_TARGETS["none"]
_LAYER_MODULES = ("vision_layer", "llm_layer")


@dataclass(frozen=True)
class ModuleCosts:
    """Fitted costs of one module at one TP degree, per rank (per layer for layer modules).

    coef maps each target (fwd_ms, bwd_ms, act_bytes, and the `OPTIONAL_TARGETS` it has) to
        non-negative coefficients, one per feature.
    param_bytes: bytes of this module's parameters on one rank, in the profiled dtype.
    tied_param_bytes: bytes of those that are the token embedding's (the LM head of a model with
        tied embeddings; 0 otherwise): a stage that holds ``llm_embed`` too holds them once.
    optimizer_s: seconds the trainer's optimizer step spends on these parameters beyond the step's
        own cost (`StepCosts.optimizer_call_s`), measured over the module's real tensors
        (`dflop.profiling.step_costs`); None when the profile did not measure it.
    profiled_batch / profiled_seq_len: (min, max) of the profiled grid, to judge extrapolation.
    """

    module: str
    tp: int
    features: tuple[str, ...]
    coef: dict[str, tuple[float, ...]]
    param_bytes: float
    n_shapes: int
    profiled_batch: tuple[int, int]
    profiled_seq_len: tuple[int, int]
    tied_param_bytes: float = 0.0
    optimizer_s: float | None = None

    @property
    def kind(self) -> ShapeKind:
        return MODULE_FEATURES[self.module][0]

    def coefficients(self, target: str) -> np.ndarray:
        return np.asarray(self.coef[target], dtype=np.float64)


@dataclass(frozen=True)
class BytesLine:
    """Seconds of an operation on n bytes: ``const_s + n * per_byte_s`` (fitted non-negative)."""

    const_s: float
    per_byte_s: float

    def __call__(self, nbytes):
        return self.const_s + np.asarray(nbytes, dtype=np.float64) * self.per_byte_s


LOAD_FEATURES = ("const", "n_tiles", "n_frames", "n_images", "text_tokens", "media_pixels")


@dataclass(frozen=True)
class LoadLine:
    """Seconds the host CPU takes to load one training sample (read, decode, resize into tiles,
    tokenise: what `dflop.data.training.TrainingData` does for the trainer's loader), as a
    non-negative line in the sample's shape: ``coef @ (1, n_tiles, n_frames, n_images,
    text_tokens, media_pixels)`` (`LOAD_FEATURES`; the shapes.parquet columns, text_tokens =
    seq_len - vision_tokens; decoding goes with the pixels, resizing with the tiles). Fitted on
    `dflop.profiling.load_profiler` timings of n_samples samples."""

    coef: tuple[float, ...]
    n_samples: int = 0

    def __call__(self, features) -> np.ndarray:
        """Seconds per sample; `features` maps each name of LOAD_FEATURES but "const" to [n] values
        (a load profile or shapes table, `dflop.pricing.pool.Pool.load_features`)."""
        return self.coef[0] + sum(c * np.asarray(features[name], dtype=np.float64)
                                  for c, name in zip(self.coef[1:], LOAD_FEATURES[1:]))


@dataclass(frozen=True)
class StepCosts:
    """Measured costs of a step outside the modules' forward and backward, on the profiled device
    (`dflop.profiling.step_costs`; None where the profile did not measure them).

    optimizer: one AdamW step (with the global-norm pass) over a rank's parameter bytes;
    optimizer_call_s: that step's cost beyond any tensor: with the modules' own
        `ModuleCosts.optimizer_s` a stage's step is this plus theirs (the bytes line is the fallback);
    allreduce: per group size, one sum all-reduce of a message of n bytes;
    p2p: one pipeline message of n bytes, sent and received;
    loading: one sample's load on the host CPU (`LoadLine`): it shares the cores with compute on a
        CPU cluster (`dflop.pricing.pricing.Pricing` charges it there) and hides behind a GPU's step.
    """

    optimizer: BytesLine | None = None
    allreduce: dict[int, BytesLine] = field(default_factory=dict)
    p2p: BytesLine | None = None
    loading: LoadLine | None = None
    optimizer_call_s: float | None = None


def loads_share_compute_cores(device: str) -> bool:
    """Whether sample loading runs on the cores that compute ("cpu" | "cuda"): on a CPU cluster it
    does, so a step pays its samples' loads (the trainer loads them in the step,
    `dflop.runtime.step_source.StepSource`, and the pricing charges them); on GPUs the loader
    prepares the next step behind this one."""
    return device == "cpu"


def charged_load_line(costs: StepCosts, device: str) -> LoadLine | None:
    """The load line a step is charged on a cluster of `device` (`loads_share_compute_cores`)."""
    return costs.loading if loads_share_compute_cores(device) else None


def step_costs_on(costs: StepCosts, profiled_on: str, device: str) -> StepCosts:
    """`costs` (measured on `profiled_on`: "cpu" or a GPU's name) where they hold on a cluster of
    `device` ("cpu" | "cuda"): on the same kind of device (a CPU profile's gloo links say nothing
    about NVLink), else none."""
    return costs if (profiled_on == "cpu") == (device == "cpu") else StepCosts()


@dataclass(frozen=True)
class Provenance:
    """Where a cost model came from: the profile it was fitted on and the training dtype."""

    preset: str | None
    device: str
    dtype: str
    profile: str = ""
    profile_sha256: str = ""
    n_profile_rows: int = 0
    created: str = ""
    dflop_version: str = ""

    def describe(self) -> str:
        """Which cost model this is, for summaries: analytic, or fitted on which device and profile."""
        if self.device.startswith("analytic"):
            return f"analytic FLOP model ({self.device}, {self.dtype}; no profile)"
        where = f"; profile {self.profile}" if self.profile else ""
        when = f", fitted {self.created[:10]}" if self.created else ""
        return f"fitted on {self.device} ({self.preset}, {self.dtype}{where}{when})"


@dataclass(frozen=True)
class StageTime:
    """Forward and backward seconds of one stage on one microbatch (or packed bin)."""

    fwd_s: float
    bwd_s: float

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s

    def __add__(self, other: "StageTime") -> "StageTime":
        return StageTime(self.fwd_s + other.fwd_s, self.bwd_s + other.bwd_s)


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of a stage needs at its peak: training state, ``in_flight`` microbatches of
    activations, and the largest transient of its modules on one microbatch (module docstring)."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # one microbatch, kept from its forward to its backward
    in_flight: int
    transient_bytes: float = 0.0  # the largest one module holds beyond what it keeps, one microbatch

    @property
    def static_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.static_bytes + self.activation_bytes * self.in_flight + self.transient_bytes

    def __add__(self, other: "StageMemory") -> "StageMemory":
        """One stage running both parts (the colocated vision tower): state and activations add up,
        transients do not (its modules run one at a time)."""
        if self.in_flight != other.in_flight:
            raise ValueError("cannot add stage memories with different in-flight counts")
        return StageMemory(
            self.param_bytes + other.param_bytes,
            self.grad_bytes + other.grad_bytes,
            self.optimizer_bytes + other.optimizer_bytes,
            self.activation_bytes + other.activation_bytes,
            self.in_flight,
            max(self.transient_bytes, other.transient_bytes),
        )


@dataclass(frozen=True)
class StageTerms:
    """A stage's costs split into a per-microbatch constant and per-sample terms.

    Time of a set S of samples = ``fwd_const_s + fwd_s[S].sum()`` (likewise bwd and activations).
    fwd_s, bwd_s: [n] seconds; act_bytes: [n] bytes; static: training state (in_flight=1, no
    activations); optimizer_s: its modules' `ModuleCosts.optimizer_s` (NaN when not measured).

    transient_const_bytes, transient_bytes: [n]: a bound of the stage's transient that is linear in
    the samples, ``transient_const_bytes + transient_bytes[S].sum()``. The transient is the largest
    of its modules' (`StageMemory`), each linear in the samples; the largest constant plus each
    sample's largest term is at least any module's sum, and equal to the largest when one module's
    terms are the largest for every sample (the LM head on a last LLM stage). The scheduler's memory
    guard needs a sum over samples; `CostModel.llm_stage_memory` takes the exact largest.
    """

    fwd_const_s: float
    bwd_const_s: float
    act_const_bytes: float
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    act_bytes: np.ndarray
    static: StageMemory = field(repr=False)
    optimizer_s: float = float("nan")
    transient_const_bytes: float = 0.0
    transient_bytes: np.ndarray | None = None

    def __post_init__(self):
        if self.transient_bytes is None:
            object.__setattr__(self, "transient_bytes", np.zeros(len(self.act_bytes)))


_MS = 1e-3


class CostModel:
    """Time and memory predictions for vision and LLM pipeline stages.

    Build one with `dflop.costmodel.fit.fit` or `jsonio.load_cost_model`; the JSON format lives in
    `dflop.costmodel.jsonio`.
    """

    def __init__(self, modules: Iterable[ModuleCosts], provenance: Provenance, step_costs: StepCosts | None = None):
        self.step_costs = step_costs if step_costs is not None else StepCosts()
        self.modules: dict[tuple[str, int], ModuleCosts] = {}
        for m in modules:
            if (m.module, m.tp) in self.modules:
                raise UserError(f"cost model has {m.module} at tp={m.tp} twice")
            self.modules[(m.module, m.tp)] = m
        self.provenance = provenance
        self.state_bytes = training_state_bytes(provenance.dtype)

    @property
    def has_transients(self) -> bool:
        """Whether any module carries transient bytes (a model without prices them 0)."""
        return any(TRANSIENT in m.coef for m in self.modules.values())

    def step_costs_on(self, device: str) -> StepCosts:
        """The measured step costs where they hold on a cluster of `device` (`step_costs_on`)."""
        return step_costs_on(self.step_costs, self.provenance.device, device)

    # ---- lookup ---------------------------------------------------------------------------------

    def module(self, name: str, tp: int) -> ModuleCosts:
        """The fitted costs of `name` at `tp`, or a one-line error naming what was profiled."""
        try:
            return self.modules[(name, int(tp))]
        except KeyError:
            profiled = sorted(t for (m, t) in self.modules if m == name)
            if not profiled:
                have = sorted({m for (m, _) in self.modules})
                raise UserError(f"no profile for {name}; profiled modules: {', '.join(have)}") from None
            raise UserError(
                f"no profile for {name} at tp={tp}; profiled tp: {', '.join(map(str, profiled))}"
            ) from None

    def tp_degrees(self, name: str) -> list[int]:
        """TP degrees `name` was profiled at."""
        return sorted(t for (m, t) in self.modules if m == name)

    # ---- stage composition ----------------------------------------------------------------------

    def _layer(self, name: str, tp: int, recompute: str) -> ModuleCosts:
        """The layer module's costs, with backward and activation coefficients of the recompute mode."""
        m = self.module(name, tp)
        if recompute == "none":
            return m
        if recompute not in RECOMPUTE_TARGETS:
            raise UserError(f"recompute mode {recompute!r} is not one of none, {', '.join(RECOMPUTE_TARGETS)}")
        bwd, act = RECOMPUTE_TARGETS[recompute]
        if bwd not in m.coef or act not in m.coef:
            raise UserError(f"cost model ({self.provenance.device}) has no {recompute}-recompute costs for {name}; "
                            "its profile predates the profiler's recompute columns (re-run `dflop profile-model`, "
                            "or use the analytic cost model)")
        coef = {**m.coef, "bwd_ms": m.coef[bwd], "act_bytes": m.coef[act]}
        transient = TRANSIENT_TARGETS[recompute]
        if transient in m.coef:
            coef[TRANSIENT] = m.coef[transient]
        elif TRANSIENT in m.coef:  # mode none's, plus what the mode drops and its backward holds again
            coef[TRANSIENT] = tuple(max(0.0, t + a - k) for t, a, k in
                                    zip(m.coef[TRANSIENT], m.coef["act_bytes"], m.coef[act]))
        return replace(m, coef=coef)

    def _vision_parts(self, n_layers: int, first: bool, last: bool, tp: int,
                      recompute: str = "none") -> list[tuple[ModuleCosts, int]]:
        _check_layers(n_layers)
        parts = [(self._layer("vision_layer", tp, recompute), n_layers)] if n_layers else []
        if first:
            parts.append((self.module("vision_embed", tp), 1))
        if last:
            parts.append((self.module("projector", tp), 1))
        return parts

    def _llm_parts(self, n_layers: int, first: bool, last: bool, tp: int,
                   recompute: str = "none") -> list[tuple[ModuleCosts, int]]:
        _check_layers(n_layers)
        parts = [(self._layer("llm_layer", tp, recompute), n_layers)] if n_layers else []
        if first:
            parts.append((self.module("llm_embed", tp), 1))
        if last:
            parts.append((self.module("llm_head", tp), 1))
        return parts

    # ---- time -----------------------------------------------------------------------------------

    def vision_stage_time(
        self, tiles_per_sample: Sequence[int], *, n_layers: int, first: bool, last: bool, tp: int,
        recompute: str = "none",
    ) -> StageTime:
        """Seconds of one vision stage on a microbatch whose samples have these tile counts.

        The per-microbatch constant is charged even when no sample has a tile.
        """
        tiles = _sizes(tiles_per_sample, "tiles_per_sample", minimum=0)
        parts = self._vision_parts(n_layers, first, last, tp, recompute)
        return _stage_time(parts, tiles)

    def llm_stage_time(
        self, seq_lens: Sequence[int], *, n_layers: int, first: bool, last: bool, tp: int,
        recompute: str = "none",
    ) -> StageTime:
        """Seconds of one LLM stage on one packed bin of samples with these lengths (tokens)."""
        lens = _sizes(seq_lens, "seq_lens", minimum=1)
        parts = self._llm_parts(n_layers, first, last, tp, recompute)
        return _stage_time(parts, lens)

    def colocated_stage_time(
        self, tiles_per_sample: Sequence[int], seq_lens: Sequence[int], *, vision_layers: int,
        llm_layers: int, last: bool, tp_v: int, tp_l: int, recompute: tuple[str, str] = ("none", "none"),
    ) -> StageTime:
        """First LLM stage carrying the whole vision tower (embeddings, all layers, projector).
        recompute: (vision mode, LLM mode)."""
        vision = self.vision_stage_time(tiles_per_sample, n_layers=vision_layers, first=True, last=True, tp=tp_v,
                                        recompute=recompute[0])
        return vision + self.llm_stage_time(seq_lens, n_layers=llm_layers, first=True, last=last, tp=tp_l,
                                            recompute=recompute[1])

    # ---- memory ---------------------------------------------------------------------------------

    def vision_stage_memory(
        self, tiles_per_sample: Sequence[int], *, n_layers: int, first: bool, last: bool, tp: int,
        in_flight: int, recompute: str = "none",
    ) -> StageMemory:
        """Bytes per rank of a vision stage holding `in_flight` microbatches like this one."""
        tiles = _sizes(tiles_per_sample, "tiles_per_sample", minimum=0)
        parts = self._vision_parts(n_layers, first, last, tp, recompute)
        return self._stage_memory(parts, tiles, in_flight)

    def llm_stage_memory(
        self, seq_lens: Sequence[int], *, n_layers: int, first: bool, last: bool, tp: int, in_flight: int,
        recompute: str = "none",
    ) -> StageMemory:
        """Bytes per rank of an LLM stage holding `in_flight` packed bins like this one."""
        lens = _sizes(seq_lens, "seq_lens", minimum=1)
        parts = self._llm_parts(n_layers, first, last, tp, recompute)
        return self._stage_memory(parts, lens, in_flight)

    def colocated_stage_memory(
        self, tiles_per_sample: Sequence[int], seq_lens: Sequence[int], *, vision_layers: int,
        llm_layers: int, last: bool, tp_v: int, tp_l: int, in_flight: int,
        recompute: tuple[str, str] = ("none", "none"),
    ) -> StageMemory:
        """Memory of the first LLM stage carrying the whole vision tower; recompute: (vision, LLM) mode."""
        vision = self.vision_stage_memory(
            tiles_per_sample, n_layers=vision_layers, first=True, last=True, tp=tp_v, in_flight=in_flight,
            recompute=recompute[0])
        return vision + self.llm_stage_memory(
            seq_lens, n_layers=llm_layers, first=True, last=last, tp=tp_l, in_flight=in_flight,
            recompute=recompute[1])

    def _stage_memory(self, parts: list[tuple[ModuleCosts, int]], sizes: np.ndarray, in_flight: int) -> StageMemory:
        if int(in_flight) < 1:
            raise UserError(f"in_flight must be >= 1, got {in_flight}")
        activation = sum(mult * _set_prediction(m, "act_bytes", sizes) for m, mult in parts)
        transient = max((_set_prediction(m, TRANSIENT, sizes) for m, _ in parts if TRANSIENT in m.coef), default=0.0)
        static = self._static(parts)
        return StageMemory(static.param_bytes, static.grad_bytes, static.optimizer_bytes,
                           float(activation), int(in_flight), float(transient))

    def _static(self, parts: list[tuple[ModuleCosts, int]], shard_over: int = 1) -> StageMemory:
        """Training state of a stage: parameters counted from their bytes in the profiled dtype;
        with the state sharded over `shard_over` replicas, what a rank holds at the step's peak
        (`dflop.costmodel.memory.training_state_bytes`)."""
        return self._state_of(sum(mult * m.param_bytes for m, mult in parts) - _held_twice_bytes(parts), shard_over)

    def tied_llm_state(self, tp: int, shard_over: int = 1) -> StageMemory:
        """Training state that an LLM stage holding both the token embedding and a tied LM head
        holds once, not twice (zeros for a model without tied embeddings)."""
        return self._state_of(self.module("llm_head", tp).tied_param_bytes, shard_over)

    def tied_llm_optimizer_s(self, tp: int) -> float:
        """Optimizer seconds such a stage spends once, not twice (`tied_llm_state`; NaN unmeasured)."""
        return _tied_share_optimizer_s(self.module("llm_head", tp))

    def _state_of(self, param_bytes: float, shard_over: int) -> StageMemory:
        n_params = param_bytes / self.state_bytes.param
        state = self.state_bytes if shard_over == 1 else training_state_bytes(self.provenance.dtype, shard_over)
        return StageMemory(
            param_bytes=float(n_params * state.param),
            grad_bytes=float(n_params * state.grad),
            optimizer_bytes=float(n_params * state.optimizer),
            activation_bytes=0.0,
            in_flight=1,
        )

    # ---- per-sample decomposition ---------------------------------------------------------------

    def vision_stage_terms(
        self, tiles_per_sample: Sequence[int], *, n_layers: int, first: bool, last: bool, tp: int,
        recompute: str = "none", shard_over: int = 1,
    ) -> StageTerms:
        """Per-sample and per-microbatch parts of a vision stage (samples with 0 tiles cost 0);
        shard_over: data-parallel replicas its optimizer state is sharded over (1: not sharded)."""
        tiles = _sizes(tiles_per_sample, "tiles_per_sample", minimum=0)
        return self._stage_terms(self._vision_parts(n_layers, first, last, tp, recompute), tiles, shard_over)

    def llm_stage_terms(
        self, seq_lens: Sequence[int], *, n_layers: int, first: bool, last: bool, tp: int,
        recompute: str = "none", shard_over: int = 1, sequence_parallel_hidden: int = 0,
    ) -> StageTerms:
        """Per-sample and per-bin parts of an LLM stage (shard_over as `vision_stage_terms`).

        sequence_parallel_hidden: the LLM's hidden size when its layers run sequence-parallel (0:
        they do not); each layer then keeps `activations.sequence_parallel_saving` fewer bytes per
        token at tp > 1. A closed form, not a fitted target: profiles measure layers without SP."""
        lens = _sizes(seq_lens, "seq_lens", minimum=1)
        terms = self._stage_terms(self._llm_parts(n_layers, first, last, tp, recompute), lens, shard_over)
        if sequence_parallel_hidden and tp > 1 and n_layers:
            from dflop.costmodel import activations  # the model configs' closed forms: transformers, imported here only

            nbytes = activations.DTYPE_BYTES[canonical_dtype(self.provenance.dtype)]
            saving = activations.sequence_parallel_saving(int(sequence_parallel_hidden), int(tp), nbytes, recompute)
            terms = replace(terms, act_bytes=terms.act_bytes - n_layers * saving * lens)
        return terms

    def _stage_terms(self, parts: list[tuple[ModuleCosts, int]], sizes: np.ndarray,
                     shard_over: int = 1) -> StageTerms:
        const = {t: 0.0 for t in TARGETS}
        per_sample = {t: np.zeros(len(sizes)) for t in TARGETS}
        transient_const, transient = 0.0, np.zeros(len(sizes))  # the bound of `StageTerms`
        for m, mult in parts:
            x = sample_features(m.features, m.kind, sizes)
            c = const_features(m.features)
            for t in TARGETS:
                coef = m.coefficients(t)
                const[t] += mult * float(c @ coef)
                per_sample[t] += mult * (x @ coef)
            if TRANSIENT in m.coef:  # one layer's, whatever mult
                coef = m.coefficients(TRANSIENT)
                transient_const = max(transient_const, float(c @ coef))
                transient = np.maximum(transient, x @ coef)
        return StageTerms(
            fwd_const_s=const["fwd_ms"] * _MS,
            bwd_const_s=const["bwd_ms"] * _MS,
            act_const_bytes=const["act_bytes"],
            fwd_s=per_sample["fwd_ms"] * _MS,
            bwd_s=per_sample["bwd_ms"] * _MS,
            act_bytes=per_sample["act_bytes"],
            static=self._static(parts, shard_over),
            optimizer_s=_optimizer_s(parts),
            transient_const_bytes=transient_const,
            transient_bytes=transient,
        )


def _head_beside_embedding(parts: list[tuple[ModuleCosts, int]]) -> ModuleCosts | None:
    """The LM head among `parts` when they hold the token embedding too: a tied head's weight is
    then the embedding's tensor (counted, stepped and synced once)."""
    if not any(m.module == "llm_embed" for m, _ in parts):
        return None
    return next((m for m, _ in parts if m.module == "llm_head"), None)


def _held_twice_bytes(parts: list[tuple[ModuleCosts, int]]) -> float:
    """Bytes the parts count twice: a tied head's weight beside the embedding."""
    head = _head_beside_embedding(parts)
    return 0.0 if head is None else float(head.tied_param_bytes)


def _optimizer_s(parts: list[tuple[ModuleCosts, int]]) -> float:
    """The parts' optimizer seconds (`ModuleCosts.optimizer_s`), a tied head's weight stepped once
    beside the embedding; NaN when a part was not measured."""
    total = sum(mult * (np.nan if m.optimizer_s is None else m.optimizer_s) for m, mult in parts)
    head = _head_beside_embedding(parts)
    return float(total if head is None else total - _tied_share_optimizer_s(head))


def _tied_share_optimizer_s(head: ModuleCosts) -> float:
    """The head's optimizer seconds on its tied weight (its share of the head's bytes)."""
    if not head.tied_param_bytes:
        return 0.0
    if head.optimizer_s is None:
        return float("nan")
    return head.optimizer_s * head.tied_param_bytes / head.param_bytes


def _stage_time(parts: list[tuple[ModuleCosts, int]], sizes: np.ndarray) -> StageTime:
    fwd = sum(mult * _set_prediction(m, "fwd_ms", sizes) for m, mult in parts)
    bwd = sum(mult * _set_prediction(m, "bwd_ms", sizes) for m, mult in parts)
    return StageTime(fwd_s=float(fwd) * _MS, bwd_s=float(bwd) * _MS)


def _set_prediction(m: ModuleCosts, target: str, sizes: np.ndarray) -> float:
    """The module's prediction for a set of samples, from the summed features of the set."""
    x = const_features(m.features) + sample_features(m.features, m.kind, sizes).sum(axis=0)
    return float(x @ m.coefficients(target))


def _sizes(values: Sequence[int], name: str, *, minimum: int) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size and (not np.all(np.isfinite(array)) or array.min() < minimum or np.any(array != np.round(array))):
        bad = array[~np.isfinite(array) | (array < minimum) | (array != np.round(array))][0]
        raise UserError(f"{name} must be whole numbers >= {minimum}, got {bad:g}")
    return array


def _check_layers(n_layers: int) -> None:
    if int(n_layers) != n_layers or n_layers < 0:
        raise UserError(f"n_layers must be a whole number >= 0, got {n_layers}")
