# Config handling shared by every rule: defaults and validation from the one schema that
# dflop.config also uses, and the per-rule settings passed on the command line.
import json
import os

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

RESULTS = config["run"]["results_dir"]
# The software stack of every rule: the project's conda environment (create and activate it
# yourself, see README; the rules run `dflop` from the active environment).
ENV_FILE = "../../environment.yml"
DEMO_DIR = config["data"]["demo"]["dir"]


def settings_json(**sections):
    """JSON of exactly the config values a rule depends on, for `dflop ... --settings`.

    Rules pass it through `params:`, so Snakemake re-runs a rule when one of these values
    changes and leaves the others alone.
    """
    return json.dumps(sections, sort_keys=True, separators=(",", ":"))


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
