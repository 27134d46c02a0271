# Config handling shared by every rule: defaults and validation from the one schema that
# dflop.config also uses, and the per-rule settings passed on the command line.
import hashlib
import json
import os
import shutil
import sys

from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from dflop.config import Config, ConfigError, resolve
from dflop.plan import read_plan

try:
    _resolved = resolve(config)
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None
config.clear()
config.update(_resolved)
# Snakemake's own check against the same schema (a no-op once resolve() passed).
validate(config, "../schemas/config.schema.yaml")

# The rules call `dflop`. Started as `.venv/bin/snakemake` from a shell where the venv is not
# active, it is not on PATH; the one installed beside Snakemake's Python is then the one meant.
_BIN = os.path.dirname(sys.executable)
if shutil.which("dflop") is None and os.access(os.path.join(_BIN, "dflop"), os.X_OK):
    os.environ.update(PATH=_BIN + os.pathsep + os.environ.get("PATH", ""))

RESULTS = config["run"]["results_dir"]
# The software stack of every rule: the project's conda environment (create and activate it
# yourself, see README; the rules run `dflop` from the active environment).
ENV_FILE = "../../environment.yml"
DEMO_DIR = config["data"]["demo"]["dir"]


class RuleSettings:
    """Exactly the config values that one rule depends on. `str()` is the JSON for `dflop ... --settings`,
    `digest` one short hash per section ("data:1a2b3c4d5e6f model:...").

    Each rule takes both as params (`settings=S, settings_digest=S.digest`). Snakemake records
    the params of builtin types, re-runs a rule when one changes and prints the old and new value
    as the reason; it does not record other objects. So the digest drives the re-runs (a changed
    value re-runs exactly the rules that use it) and the reason is one short line naming the
    changed section, instead of two copies of the whole JSON.
    """

    def __init__(self, **sections):
        self.json = json.dumps(sections, sort_keys=True, separators=(",", ":"))
        self.digest = " ".join(
            f"{name}:{hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]}"
            for name, value in sorted(sections.items())
        )

    def __str__(self):
        return self.json


def datasets_setting(weights: bool) -> list:
    """data.datasets as a rule's settings. weights=False: without `weight` (what the data stages
    read does not depend on the mix); True: with it only where set, so a config without weights has
    the settings (and digests) it had before weights existed."""
    return [{k: v for k, v in ds.items() if k != "weight" or (weights and v is not None)}
            for ds in config["data"]["datasets"]]


def dataset_files(wildcards=None):
    """Files whose change must re-run profile_data: each manifest, or each Parquet part of a directory."""
    files = []
    for ds in config["data"]["datasets"]:
        path = Path(ds["path"])
        if path.is_dir():
            parts = sorted(str(p) for p in path.glob("*.parquet"))
            if not parts:
                raise WorkflowError(f"data.datasets: {ds['name']}: no .parquet files in {path}")
            files.extend(parts)
        else:
            files.append(str(path))
    return files


def profile_co_runners():
    """Ranks that run the model profiler's sweep together (`ProfileSection.co_runners_on`)."""
    typed = Config.from_dict(config)
    return typed.profile.co_runners_on(typed.cluster)


def plan_world_size(path):
    return read_plan(path).plan.world_size


def train_nodes(wildcards, input):
    """Nodes the plan needs: its world size over the GPUs (processes on CPU) per node."""
    per_node = config["cluster"]["gpus_per_node"]
    return max(1, -(-plan_world_size(input.plan) // per_node))


def train_gres(wildcards, input):
    if config["cluster"]["device"] != "cuda":
        return ""
    return f"gpu:{min(plan_world_size(input.plan), config['cluster']['gpus_per_node'])}"


def summary_inputs(wildcards):
    """plan.yaml, and the training runs' metrics where the workflow trains them (report.smk's
    HAS_TRAIN / HAS_TRAIN_BASELINE, read when the DAG is built): the plan's and the baseline's that
    rule summary compares."""
    inputs = {"plan": rules.optimize.output.plan}
    if HAS_TRAIN:
        inputs["metrics"] = rules.train.output.metrics
    if HAS_TRAIN_BASELINE:
        inputs["baseline_metrics"] = rules.train_baseline.output.metrics
        if COMPARE_WITH_HF:  # the plan's run taken in turn with the baseline's (rule train_baseline)
            inputs["metrics"] = rules.train_baseline.output.plan_metrics
    return inputs


def summary_arguments(wildcards, input):
    return "".join(f" --{key.replace('_', '-')} {input[key]}" for key in ("metrics", "baseline_metrics")
                   if key in input.keys())
