"""The workflow's light rules (the summary; the training, summary and cost-model figures) start
without torch or transformers: each is a process of its own in every chain, and importing those
costs seconds of CPU that a rule reading a few Parquet and JSON files should not pay."""

import subprocess
import sys

import pytest

LIGHT_MODULES = ("dflop.runtime.comparison", "dflop.report.training_plots", "dflop.report.summary_plots",
                 "dflop.report.costmodel_plots", "dflop.costmodel.profile_table")


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_module_imports_neither_torch_nor_transformers(module):
    probe = (f"import sys, {module}; "
             "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); print(*heavy)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing {module} imports {out}"
