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
    # One schema: the workflow's copy is a link to the package's file, not a second file, and the
    # package's is a real file (a link would dangle in a wheel or a copied tree).
    assert not cfgmod.SCHEMA_PATH.is_symlink()
    assert cfgmod.SCHEMA_PATH.resolve() == (REPO / "workflow/schemas/config.schema.yaml").resolve()


def test_empty_config_gets_every_default():
    cfg = cfgmod.Config.from_dict({})
    assert cfg.model.arch == "llava_ov"
    assert cfg.raw["data"]["max_skip_frac"] == 0.01
    assert cfg.raw["model"]["llava_ov"]["anyres_max_tiles"] == 9
    assert cfg.datasets[0].name == "demo" and cfg.datasets[0].sample == "all"


@pytest.mark.parametrize("profile, cluster, expected", [
    ({}, {"gpus_per_node": 3}, 3),  # CPU: the ranks that will share the node's cores
    ({"device": "cuda"}, {"gpus_per_node": 3}, 1),  # one rank per GPU: none shares a device
    ({"co_runners": 1}, {"gpus_per_node": 3}, 1),  # what the config says
    ({"co_runners": 2, "device": "cuda"}, {"gpus_per_node": 8}, 2),
])
def test_profilers_co_run_with_what_training_puts_beside_each_rank(profile, cluster, expected):
    cfg = cfgmod.Config.from_dict({"profile": profile, "cluster": cluster})
    assert cfg.profile.co_runners_on(cfg.cluster) == expected


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


@pytest.mark.parametrize("text, key, shown", [("cluster:\n  gpu_memory_gb: .nan\n", "cluster.gpu_memory_gb", "nan"),
                                             ("data:\n  max_skip_frac: .nan\n", "data.max_skip_frac", "nan"),
                                             ("planner:\n  time_limit_s: .inf\n", "planner.time_limit_s", "inf")])
def test_non_finite_numbers_name_the_key(tmp_path, text, key, shown):
    """The schema's minimum/maximum pass NaN: a NaN GPU memory let every plan "fit"."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^config error: {key}: {shown} is not a finite number$"):
        cfgmod.load(path)


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


# --- dflop check-config: beyond the schema, what the stages will look up -------------------------


def _check_config(tmp_path, capsys, raw: dict) -> tuple[int, str, list[str]]:
    from dflop.cli import main

    path = tmp_path / "check.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = main(["check-config", "--config", str(path)])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def _one_error(tmp_path, capsys, raw: dict) -> str:
    code, out, err = _check_config(tmp_path, capsys, raw)
    assert code == 2 and out == "" and len(err) == 1, (code, out, err)
    assert err[0].startswith("dflop check-config: ")
    return err[0].removeprefix("dflop check-config: ")


def test_check_config_accepts_existing_data_and_known_presets(tmp_path, capsys, demo_manifest):
    code, out, err = _check_config(tmp_path, capsys, {"data": {"datasets": [{"name": "d", "path": str(demo_manifest)}]}})
    assert code == 0 and err == []
    assert out == "config ok: arch=llava_ov vision=siglip-tiny llm=qwen2.5-tiny datasets=d\n"


def test_check_config_names_a_missing_dataset(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    raw = {"data": {"datasets": [{"name": "mine", "path": str(missing)}]}}
    assert _one_error(tmp_path, capsys, raw) == f"data.datasets[0] (mine): dataset {missing}: no such file or directory"


def test_check_config_names_an_unreadable_dataset_and_a_bad_rule(tmp_path, capsys, demo_manifest):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    raw = {"data": {"datasets": [{"name": "ok", "path": str(demo_manifest)}, {"name": "junk", "path": str(junk)}]}}
    assert _one_error(tmp_path, capsys, raw).startswith(f"data.datasets[1] (junk): dataset {junk}: unreadable Parquet file (")
    raw = {"data": {"datasets": [{"name": "ok", "path": str(demo_manifest), "sample": "250%"}]}}
    assert _one_error(tmp_path, capsys, raw) == ("data.datasets[0] (ok).sample: sampling rule '250%': "
                                                 "percentage must be in (0, 100]")


@pytest.mark.parametrize("model, message", [
    ({"vision": "siglip-huge"}, "model.vision: unknown vision preset 'siglip-huge'; known: siglip-so400m, "),
    ({"llm": "qwen9"}, "model.llm: unknown LLM preset 'qwen9'; known: qwen2.5-0.5b, "),
    ({"arch": "internvl", "vision": "siglip-tiny"}, "model.vision: architecture 'internvl' needs a internvit tower"),
])
def test_check_config_names_an_unknown_or_mismatched_preset(tmp_path, capsys, demo_manifest, model, message):
    raw = {"model": model, "data": {"datasets": [{"name": "d", "path": str(demo_manifest)}]}}
    assert _one_error(tmp_path, capsys, raw).startswith(message)


def test_check_config_with_local_weights(tmp_path, capsys, demo_manifest):
    # With model.weights the model comes from the directory's config.json (model.llm only names
    # it); model.vision must still be a preset: its tile size sets the data profiler's token rules.
    from dflop.models.builder import model_config

    import torch
    from safetensors.torch import save_file

    weights = tmp_path / "my-llava"
    model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny").save_pretrained(weights)
    data = {"datasets": [{"name": "d", "path": str(demo_manifest)}]}
    assert _one_error(tmp_path, capsys, {"model": {"weights": str(weights)}, "data": data}) == (
        f"model.weights: {weights} has no *.safetensors files (pickled checkpoints are not loaded)")
    save_file({"lm_head.weight": torch.zeros(1)}, weights / "model.safetensors")  # train checks the names
    code, out, _ = _check_config(tmp_path, capsys, {"model": {"weights": str(weights), "llm": "my-finetune"}, "data": data})
    assert code == 0 and out.startswith("config ok: arch=llava_ov vision=siglip-tiny llm=my-finetune ")
    assert _one_error(tmp_path, capsys, {"model": {"weights": str(weights), "vision": "mine"}, "data": data}).startswith(
        "model.vision: unknown vision preset 'mine'")
    assert _one_error(tmp_path, capsys, {"model": {"weights": str(weights), "arch": "internvl", "vision": "internvit-tiny"},
                                         "data": data}) == (
        f"model.weights: {weights} holds a 'llava_ov' model but model.arch is 'internvl'")
    assert _one_error(tmp_path, capsys, {"model": {"weights": str(tmp_path / "nothing")}, "data": data}) == (
        f"model.weights: {tmp_path / 'nothing'} is not a Hugging Face model directory (no config.json)")


def test_shipped_default_config_checks_before_the_demo_data_exists(tmp_path, capsys, monkeypatch):
    # Its dataset is the demo manifest that the workflow's make_demo_data rule writes.
    monkeypatch.chdir(tmp_path)
    code, out, err = _check_config(tmp_path, capsys, cfgmod.load_yaml(REPO / "config/config.yaml"))
    assert code == 0 and err == [] and out.endswith("datasets=demo (to be made by make_demo_data)\n")
