"""Config loading: defaults from the schema, one-line errors naming the key, typed views."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflop import config as cfgmod
from dflop.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_schema_is_the_workflow_file():
    # One schema: the package's copy is a link to the workflow's file, not a second file.
    assert cfgmod.SCHEMA_PATH.resolve() == (REPO / "workflow/schemas/config.schema.yaml").resolve()


def test_empty_config_gets_every_default():
    cfg = cfgmod.Config.from_dict({})
    assert cfg.model.arch == "llava_ov"
    assert cfg.raw["data"]["max_skip_frac"] == 0.01
    assert cfg.raw["model"]["llava_ov"]["anyres_max_tiles"] == 9
    assert cfg.datasets[0].name == "demo" and cfg.datasets[0].sample == "all"


def test_shipped_configs_validate():
    for path in [REPO / "config/config.yaml", *sorted((REPO / "config/examples").glob("*.yaml"))]:
        cfgmod.load(path)


def test_nested_defaults_fill_list_items():
    cfg = cfgmod.Config.from_dict({"data": {"datasets": [{"name": "a", "path": "a.jsonl"}]}})
    assert cfg.datasets[0].format == "auto" and cfg.datasets[0].media_root is None


@pytest.mark.parametrize(
    "raw, key, rule",
    [
        ({"data": {"max_skip_frac": 2}}, "data.max_skip_frac", "maximum"),
        ({"data": {"datasetz": []}}, "data.datasetz", "additionalProperties"),
        ({"model": {"arch": "gpt"}}, "model.arch", "enum"),
        ({"data": {"datasets": [{"name": "a", "path": "x", "sample": "rand:3"}]}}, "data.datasets[0].sample", "pattern"),
        ({"data": {"datasets": [{"name": "a"}]}}, "data.datasets[0]", "required"),
        ({"data": {"datasets": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}}, "data.datasets[1].name", "unique"),
        ({"run": {"seed": "zero"}}, "run.seed", "type"),
        ({"data": 5}, "data", "type"),
    ],
)
def test_bad_values_give_one_line_naming_key_and_rule(raw, key, rule):
    with pytest.raises(ConfigError) as info:
        cfgmod.Config.from_dict(raw)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"config error: {key}:")
    assert message.endswith(f"(rule: {rule})")


def test_settings_json_overrides_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run": {"seed": 3}, "data": {"max_skip_frac": 0.5}}))
    cfg = cfgmod.load(path, json.dumps({"data": {"max_skip_frac": 0.2}}))
    assert cfg.seed == 3 and cfg.raw["data"]["max_skip_frac"] == 0.2


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  seed: [1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: not valid YAML"):
        cfgmod.load(path)


def test_cli_reports_config_error_in_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  arch: gpt\n")
    proc = subprocess.run([sys.executable, "-m", "dflop.cli", "check-config", "--config", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["dflop check-config: config error: model.arch: 'gpt' is not one of ['llava_ov', 'internvl'] (rule: enum)"]
