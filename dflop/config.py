"""Load, default and validate the workflow configuration.

The schema lives in the package, ``dflop/config.schema.yaml`` (so any install, editable or not,
carries it; ``workflow/schemas/config.schema.yaml`` is a link to it). The Snakefile validates with the same schema,
so a config accepted by one is accepted by the other. Errors are one line that names the key and
the schema rule it broke, e.g. ``config error: data.max_skip_frac: 2 is greater than the maximum of 1
(rule: maximum)``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

from dflop.errors import UserError
from dflop.finite import check_finite_document
from dflop.io import read_yaml

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")


class ConfigError(UserError, ValueError):
    """A configuration problem, described in one line that names the key."""


@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The config JSON schema (parsed once)."""
    if not SCHEMA_PATH.exists():
        raise ConfigError(f"config schema not found at {SCHEMA_PATH} (is the package installed from a checkout?)")
    with open(SCHEMA_PATH) as f:
        return yaml.safe_load(f)


def fill_defaults(raw: Mapping[str, Any] | None, schema: Mapping[str, Any] | None = None) -> dict:
    """Return a deep copy of `raw` with every missing key set to its schema default.

    Only descends into values of the right container type, so a wrongly typed value is left
    for validation to report instead of crashing here.
    """
    schema = load_schema() if schema is None else schema
    out = copy.deepcopy(dict(raw or {}))
    _fill(out, schema)
    return out


def _fill(value: Any, schema: Mapping[str, Any]) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _fill(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _fill(item, schema["items"])


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) if not isinstance(p, int) else f"[{p}]" for p in error.absolute_path]
    dotted = ".".join(parts).replace(".[", "[")
    if error.validator == "additionalProperties":
        # The offending key is in the message, not in the path.
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        dotted = ".".join(p for p in (dotted, extra[0] if extra else "") if p)
    return dotted or "<top level>"


def _one_line(error: jsonschema.ValidationError) -> str:
    key = _key_path(error)
    if error.validator == "additionalProperties":
        allowed = ", ".join(sorted(error.schema.get("properties", {})))
        return f"config error: {key}: unknown key (allowed: {allowed}) (rule: additionalProperties)"
    message = error.message.replace("\n", " ")
    return f"config error: {key}: {message} (rule: {error.validator})"


def validate(config: Mapping[str, Any]) -> None:
    """Raise ConfigError (one line naming the key and rule) if `config` breaks the schema or holds
    a NaN or infinite number (YAML's .nan/.inf pass a schema's minimum and end up in plan.yaml)."""
    try:
        check_finite_document(config, "config error")
    except UserError as exc:
        raise ConfigError(str(exc)) from None
    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        raise ConfigError(_one_line(errors[0]))


def resolve(raw: Mapping[str, Any] | None) -> dict:
    """Defaults filled in and validated: the plain dict every stage sees."""
    config = fill_defaults(raw)
    validate(config)
    return config


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config file; a syntax error names the file and line."""
    path = Path(path)
    try:
        data = read_yaml(path, missing_hint="check the config path")
    except UserError as exc:
        raise ConfigError(f"config error: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config error: {path}: top level must be a mapping, got {type(data).__name__}")
    return data or {}


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict:
    """`override` laid over `base`; mappings merge key by key, everything else is replaced."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_settings(text: str) -> dict:
    """Parse the JSON settings a Snakemake rule passes on the command line (`--settings`)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config error: --settings is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(data, dict):
        raise ConfigError("config error: --settings must be a JSON object")
    return data


# --- typed sections ------------------------------------------------------------------------------
#
# One frozen dataclass per section, built from the defaulted, validated mapping. No field has a
# default: every default lives in the schema (tests/test_config_defaults.py holds the two together).


def _typed(cls, values: Mapping[str, Any]):
    """`cls` from a section mapping: each field from its key, lists as tuples."""
    kwargs = {}
    for f in fields(cls):
        value = values[f.name]
        kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


@dataclass(frozen=True)
class RunSection:
    seed: int
    results_dir: str


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset of the mix: where it is and which of its samples to use."""

    name: str
    path: Path
    format: str
    media_root: Path | None
    allow_absolute_paths: bool
    sample: str
    weight: float | None  # sampling ratio in the mix (`dflop.data.sampling.DatasetMix`); None: by size

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DatasetSpec":
        """From a ``data.datasets`` entry; missing keys take the schema's defaults."""
        item = copy.deepcopy(dict(d))
        _fill(item, load_schema()["properties"]["data"]["properties"]["datasets"]["items"])
        media_root = item["media_root"]
        return cls(name=item["name"], path=Path(item["path"]), format=item["format"],
                   media_root=Path(media_root) if media_root else None,
                   allow_absolute_paths=item["allow_absolute_paths"], sample=item["sample"],
                   weight=None if item["weight"] is None else float(item["weight"]))


@dataclass(frozen=True)
class DemoSection:
    dir: str
    n_samples: int
    seed: int


@dataclass(frozen=True)
class DataSection:
    datasets: tuple[DatasetSpec, ...]
    demo: DemoSection
    max_skip_frac: float
    workers: int
    load_profile_samples: int
    load_profile_seconds: float

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DataSection":
        return cls(datasets=tuple(DatasetSpec.from_dict(x) for x in d["datasets"]), demo=_typed(DemoSection, d["demo"]),
                   max_skip_frac=d["max_skip_frac"], workers=d["workers"],
                   load_profile_samples=d["load_profile_samples"], load_profile_seconds=d["load_profile_seconds"])


@dataclass(frozen=True)
class ModelSpec:
    """Which model the stages profile and train, and how its inputs are tokenised (the ``model``
    section; ``arch_params`` is the sub-section of ``arch``: llava_ov or internvl)."""

    arch: str
    vision: str
    llm: str
    weights: str | None
    tokenizer: str
    dtype: str
    packed_attention: str
    freeze_vision: bool
    freeze_projector: bool
    freeze_llm: bool
    arch_params: Mapping[str, Any]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
        return cls(arch=d["arch"], vision=d["vision"], llm=d["llm"], weights=d["weights"], tokenizer=d["tokenizer"],
                   dtype=d["dtype"], packed_attention=d["packed_attention"], freeze_vision=d["freeze"]["vision"], freeze_projector=d["freeze"]["projector"],
                   freeze_llm=d["freeze"]["llm"], arch_params=dict(d[d["arch"]]))

    @property
    def preset(self) -> str:
        """``arch/vision/llm``, the name cost-model profiles record."""
        return f"{self.arch}/{self.vision}/{self.llm}"


@dataclass(frozen=True)
class ProfileSection:
    """The model profiler (rule profile_model)."""

    device: str
    tp_degrees: tuple[int, ...]
    max_tiles: int
    max_seq_len: int
    repeats: int
    warmup: int
    min_measure_ms: float
    max_repeats: int
    time_budget_s: float
    co_runners: int | None

    def co_runners_on(self, cluster: "ClusterSection") -> int:
        """Ranks that profile together: the configured number, else the ranks training puts on one
        node when they share its CPU (one per GPU on CUDA, where each has its own device)."""
        if self.co_runners is not None:
            return self.co_runners
        return cluster.gpus_per_node if self.device == "cpu" else 1


@dataclass(frozen=True)
class SchedulerSection:
    """The online microbatch scheduler."""

    policy: str
    pad_to_longest: bool
    ilp: str
    budget_ms: float
    prefetch: int


@dataclass(frozen=True)
class ClusterSection:
    """The machines the plan is for (config units: GB, GB/s, microseconds)."""

    device: str
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    intra_node_gbps: float
    inter_node_gbps: float
    p2p_latency_us: float


@dataclass(frozen=True)
class PlannerSection:
    """The data-aware 3D parallelism optimizer (rule optimize)."""

    placements: tuple[str, ...]
    microbatches: tuple[int, ...]
    sample_batches: int
    top_k: int
    time_limit_s: float
    rel_gap: float
    recompute: str  # auto | none | selective | full
    shard_optimizer: str | bool  # "auto" or forced
    sequence_parallel: str | bool  # "auto" or forced
    schedules: tuple[str, ...]  # LLM pipeline schedules the planner may choose (1f1b always among them)


@dataclass(frozen=True)
class TrainSection:
    """The training run (rule train)."""

    global_batch_size: int
    steps: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    checkpoint_every: int
    schedule: str
    loader_workers: int
    overlap_grad_sync: bool
    trace_steps: tuple[int, int]
    compare_with_hf_trainer: bool


@dataclass(frozen=True)
class Config:
    """The validated configuration, one typed section per top-level key; `raw` keeps the
    defaulted mapping (what Snakemake rules pass on)."""

    raw: Mapping[str, Any]
    run: RunSection
    model: ModelSpec
    data: DataSection
    profile: ProfileSection
    scheduler: SchedulerSection
    cluster: ClusterSection
    planner: PlannerSection
    train: TrainSection

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "Config":
        resolved = resolve(raw)
        _check_unique_dataset_names(resolved["data"]["datasets"])
        _check_dataset_weights(resolved["data"]["datasets"])
        return cls(raw=resolved, run=_typed(RunSection, resolved["run"]), model=ModelSpec.from_dict(resolved["model"]),
                   data=DataSection.from_dict(resolved["data"]), profile=_typed(ProfileSection, resolved["profile"]),
                   scheduler=_typed(SchedulerSection, resolved["scheduler"]),
                   cluster=_typed(ClusterSection, resolved["cluster"]),
                   planner=_typed(PlannerSection, resolved["planner"]), train=_typed(TrainSection, resolved["train"]))

    @property
    def seed(self) -> int:
        return self.run.seed

    @property
    def datasets(self) -> tuple[DatasetSpec, ...]:
        return self.data.datasets


def _check_unique_dataset_names(datasets: list[Mapping[str, Any]]) -> None:
    seen: set[str] = set()
    for i, d in enumerate(datasets):
        if d["name"] in seen:
            raise ConfigError(f"config error: data.datasets[{i}].name: duplicate dataset name {d['name']!r} (rule: unique)")
        seen.add(d["name"])


def _check_dataset_weights(datasets: list[Mapping[str, Any]]) -> None:
    """Weights on every dataset or on none, and not all zero (the schema refuses negative and
    non-numeric ones)."""
    weights = [d.get("weight") for d in datasets]
    if all(w is None for w in weights):
        return
    for i, w in enumerate(weights):
        if w is None:
            raise ConfigError(f"config error: data.datasets[{i}].weight: missing while other datasets have one "
                              "(rule: a weight on every dataset or on none)")
    if sum(weights) <= 0:
        raise ConfigError("config error: data.datasets[].weight: all zero (rule: at least one positive weight)")


def load(path: str | Path | None = None, settings: str | None = None) -> Config:
    """Config from a YAML file and/or a JSON settings string (settings win), defaulted and validated."""
    raw: dict = load_yaml(path) if path else {}
    if settings:
        raw = deep_merge(raw, parse_settings(settings))
    return Config.from_dict(raw)
