"""The workflow's light rules (the summary; the training, summary and cost-model figures) start
without torch or transformers: each is a process of its own in every chain, and importing those
costs seconds of CPU that a rule reading a few Parquet and JSON files should not pay. Commands that
read the model's config but build no model start without transformers' model classes."""

import subprocess
import sys
from pathlib import Path

import pytest

LIGHT_MODULES = ("dflop.runtime.comparison", "dflop.report.training_plots", "dflop.report.summary_plots",
                 "dflop.report.costmodel_plots", "dflop.costmodel.profile_table")


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_module_imports_neither_torch_nor_transformers(module):
    probe = (f"import sys, {module}; "
             "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); print(*heavy)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing {module} imports {out}"


def model_class_modules(names) -> list[str]:
    """transformers' model classes among the module names `names`: `transformers.modeling_utils`
    (PreTrainedModel) and each family's `modeling_<family>`. Allowed: what the config classes pull
    in themselves (`modeling_rope_utils`, `modeling_outputs`, the name registry `models.auto.modeling_auto`)."""
    return sorted(n for n in names if n == "transformers.modeling_utils"
                  or (n.startswith("transformers.models.") and ".modeling_" in n
                      and not n.startswith("transformers.models.auto.")))


def imported_modules(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime -m dflop.cli *args`; its result and every module it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dflop.cli", *args], capture_output=True,
                          text=True, cwd=cwd)
    names = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, names


def test_model_class_filter():
    """`model_class_modules` names what building a model imports and lets through what the config
    classes import themselves: a filter that matched nothing would let every command pass."""
    assert model_class_modules({"transformers.models.qwen2.modeling_qwen2", "transformers.modeling_utils",
                                "transformers.models.auto.modeling_auto", "transformers.modeling_rope_utils"}) == [
        "transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2"]


LIGHT_PLAN = {"vision": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
              "llm": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]}, "placement": "disjoint",
              "microbatches": 2, "global_batch_size": 16, "world_size": 2}


@pytest.mark.parametrize("command", ["train", "check-config"])
def test_commands_that_read_the_model_structure_import_no_model_classes(tmp_path, command):
    """`dflop train`'s parent (it checks the plan against the model's layers and TP degrees, then
    starts torchrun; the ranks build the model) and `dflop check-config` read the model's config,
    not the model: they may import torch and transformers' config classes, not its model classes.
    The launcher is run to its check of the plan against the model's layers (a plan refused there
    says how many layers the model has: it read them)."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    if command == "train":
        plan = tmp_path / "plan.yaml"
        plan.write_text(yaml.safe_dump({**LIGHT_PLAN, "llm": {**LIGHT_PLAN["llm"], "layers_per_stage": [3]}}))
        (tmp_path / "shapes.parquet").write_bytes(b"")  # never read: refused first
        args = ["train", "--plan", str(plan), "--shapes", str(tmp_path / "shapes.parquet"),
                "--out-dir", str(tmp_path / "train")]
        expected_rc, expected = 2, "sums to 3 but the model has 2 llm layers"
    else:
        args, expected_rc, expected = ["check-config"], 0, "config ok: arch=llava_ov"
    proc, names = imported_modules(args, root)
    assert proc.returncode == expected_rc and expected in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert model_class_modules(names) == []


def test_simulating_modules_import_no_matplotlib():
    """The planner (`dflop optimize`) and the trainer (every rank, through its scheduler) simulate
    pipelines but draw nothing: `dflop.sim.plot_gantt` brings matplotlib only when called. (One
    interpreter for both: each costs seconds of CPU to import.)"""
    probe = ("import sys, dflop.planner, dflop.runtime.trainer; "
             "print(*sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing the planner and the trainer imports {out}"
