"""LR schedule, optimizer groups and the global gradient norm; metrics file; launcher command."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest
import torch

from dflop.errors import UserError
from dflop.models.info import model_info
from dflop.plan import plan_from_dict, write_plan
from dflop.runtime.launch import slurm_command, srun_environment, torchrun_command
from dflop.runtime.metrics import step_flops
from dflop.models.optimizer import build_optimizer
from dflop.runtime.optim import GradientSync, ParamInfo, warmup_cosine
from dflop.runtime.topology import Topology


def test_warmup_then_cosine_closed_form():
    lr = [warmup_cosine(s, total_steps=10, warmup_steps=3, min_lr_ratio=0.1) for s in range(10)]
    assert lr[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert lr[3] == pytest.approx(1.0) and lr[9] == pytest.approx(0.1)
    # halfway through the decay: min + (1 - min) * (1 + cos(pi / 2)) / 2
    assert warmup_cosine(3 + 3, total_steps=10, warmup_steps=3, min_lr_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert all(a >= b for a, b in zip(lr[3:], lr[4:]))
    assert warmup_cosine(0, total_steps=1, warmup_steps=0, min_lr_ratio=0.0) == pytest.approx(1.0)


def test_weight_decay_only_on_matrices():
    w, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer([("w", w), ("b", b)], lr=0.1, weight_decay=0.5)
    assert [(g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [(0.5, 1), (0.0, 1)]


def _single_rank_topology():
    plan = plan_from_dict({"vision": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [1]},
                           "llm": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [1]}, "placement": "colocated",
                           "microbatches": 1, "global_batch_size": 1, "world_size": 1}).plan
    return Topology(plan, 0, 1)


def test_global_norm_and_clipping_on_one_rank():
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = torch.tensor([3.0, 0, 0, 0]), torch.tensor([[0.0, 4.0], [0, 0]])
    sync = GradientSync(_single_rank_topology(), {a: ParamInfo("a", "llm", False, False),
                                                  b: ParamInfo("b", "vision", False, False)})
    norm = sync.global_norm(torch.device("cpu"))
    assert norm == pytest.approx(5.0)
    sync.clip(1.0, norm)
    assert torch.cat([a.grad, b.grad.flatten()]).norm() == pytest.approx(1.0, rel=1e-5)
    sync.clip(0.0, 100.0)  # 0 = no clipping
    assert torch.cat([a.grad, b.grad.flatten()]).norm() == pytest.approx(1.0, rel=1e-5)


def test_tied_copies_and_replicated_tensors_are_counted_once():
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([2.0])
    sync = GradientSync(_single_rank_topology(),
                        {p: ParamInfo("model.language_model.embed_tokens.weight", "llm", False, tied_copy=True)})
    assert sync.global_norm(torch.device("cpu")) == 0.0


def test_step_flops_closed_form():
    info = replace(model_info("llava_ov", "siglip-tiny", "qwen2.5-tiny"), vision_layers=2, vision_hidden=8,
                   vision_tokens_per_tile=4, llm_tokens_per_tile=4, llm_layers=3, llm_hidden=16,
                   vision_embed_params=5, vision_layer_params=7, projector_params=11, llm_layer_params=13,
                   llm_head_params=17)
    per_tile = 2 * (5 + 2 * 7) * 4 + 2 * 4 * 16 * 8 + 2 * 11 * 4
    llm = 2 * (3 * 13 + 17) * (10 + 20) + 3 * 2 * 16 * (10**2 + 20**2)
    assert step_flops(info, [1, 2], [10, 20]) == pytest.approx(3 * (3 * per_tile + llm))
    assert step_flops(info, [1, 2], [10, 20], vision_trainable=False, llm_trainable=False) == pytest.approx(
        3 * per_tile + 2 * llm)


def test_torchrun_command_from_the_plan(tmp_path):
    plan = plan_from_dict({"vision": {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2]},
                           "llm": {"tp": 1, "pp": 2, "dp": 1, "layers_per_stage": [1, 1]}, "placement": "disjoint",
                           "microbatches": 2, "global_batch_size": 4, "world_size": 4}).plan
    path = tmp_path / "plan.yaml"
    write_plan(plan.to_dict(4), path)
    single = torchrun_command(path, ["--plan", str(path)], python="py")
    assert single == ["py", "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
                      "-m", "dflop.runtime.launch", "--plan", str(path)]
    multi = torchrun_command(path, [], nodes=2, rdzv_endpoint="node1:29500", python="py")
    assert multi[:5] == ["py", "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    assert "--rdzv-backend" in multi and multi[multi.index("--rdzv-endpoint") + 1] == "node1:29500"
    with pytest.raises(UserError, match="world_size 4 does not split over 3 node"):
        torchrun_command(path, [], nodes=3, rdzv_endpoint="x:1")
    with pytest.raises(UserError, match="needs --rdzv-endpoint"):
        torchrun_command(path, [], nodes=2)


def test_srun_inside_a_job_step_spans_the_job_and_drops_the_step_environment(tmp_path):
    # Snakemake runs the rule in a one-node step; its SLURM_* variables would pin srun to that node.
    step_env = {"SLURM_JOB_ID": "42", "SLURM_NODELIST": "node1", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0",
                "SRUN_DEBUG": "3", "SBATCH_PARTITION": "debug", "PATH": "/bin", "HOME": "/root",
                "SLURM_CONF": "/etc/site/slurm.conf"}
    assert srun_environment(step_env) == {"SLURM_JOB_ID": "42", "PATH": "/bin", "HOME": "/root",
                                          "SLURM_CONF": "/etc/site/slurm.conf"}
    plan = plan_from_dict({"vision": {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2]},
                           "llm": {"tp": 1, "pp": 2, "dp": 1, "layers_per_stage": [1, 1]}, "placement": "disjoint",
                           "microbatches": 2, "global_batch_size": 4, "world_size": 4}).plan
    write_plan(plan.to_dict(4), tmp_path / "plan.yaml")
    cmd = slurm_command(tmp_path / "plan.yaml", [], ["node1", "node2"], job_id="42")
    assert cmd[:6] == ["srun", "--overlap", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "node1:29500" and cmd[cmd.index("--rdzv-id") + 1] == "dflop-42"
    with_cpus = slurm_command(tmp_path / "plan.yaml", [], ["node1", "node2"], job_id="42", cpus_per_task=64)
    assert "--cpus-per-task=64" in with_cpus[:with_cpus.index("--kill-on-bad-exit=1")]


def test_padded_baseline_is_a_config_key():
    from dflop.config import load
    from dflop.runtime.settings import TrainSettings

    cfg = load(None, '{"scheduler": {"policy": "baseline", "pad_to_longest": true}}')
    settings = TrainSettings.from_config(cfg)
    assert settings.scheduler.policy == "baseline" and settings.scheduler.pad_to_longest and settings.baseline
    assert not TrainSettings.from_config(load(None, None)).scheduler.pad_to_longest  # packed by default
    assert not TrainSettings.from_config(cfg, pad_to_longest=False).scheduler.pad_to_longest  # `dflop train` flag wins
    assert TrainSettings.from_config(cfg, pad_to_longest=None).scheduler.pad_to_longest  # None: no flag given
    with pytest.raises(TypeError, match="cannot override 'lr'"):
        TrainSettings.from_config(cfg, lr=1.0)


def _mixed_parameters_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    twins = []  # (DTensor parameter, plain parameter with the same values): a matrix and a bias
    for shape in ((4, 2), (4,)):
        value = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        twins.append((torch.nn.Parameter(distribute_tensor(value, mesh, [Shard(0)])), torch.nn.Parameter(value)))
    params = [(f"p{i}", p) for i, pair in enumerate(twins) for p in pair]
    optimizer = build_optimizer(params, lr=0.1, weight_decay=0.5, foreach=True)  # CUDA's default path
    for _, p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # one list mixing DTensor and plain tensors would raise here
    assert len(optimizer.param_groups) == 4
    for distributed, plain in twins:
        assert torch.allclose(distributed.full_tensor(), plain.detach())


@pytest.mark.distributed
def test_optimizer_keeps_dtensor_and_plain_parameters_apart_for_foreach(tmp_path):
    from test_checkpoint_helpers import spawn

    spawn(_mixed_parameters_worker, 1, tmp_path)


GOOD_PLAN = {"vision": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
             "llm": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]}, "placement": "disjoint",
             "microbatches": 2, "global_batch_size": 16, "world_size": 2}


@pytest.mark.parametrize("name, change, settings, message", [
    ("layers", {"llm": {**GOOD_PLAN["llm"], "layers_per_stage": [3]}}, "{}",
     "llm.layers_per_stage [3] sums to 3 but the model has 2 llm layers"),
    ("world", {"world_size": 3}, "{}", "world_size is 3 but the layout needs 2 ranks"),
    ("tp", {"llm": {**GOOD_PLAN["llm"], "tp": 3}, "world_size": 4}, '{"cluster": {"gpus_per_node": 4}}',
     "llm.tp is 3, which does not split"),
    ("gpus", {}, '{"cluster": {"gpus_per_node": 1}}', "needs 2 GPUs but the cluster has 1"),
    ("launchable", {"llm": {**GOOD_PLAN["llm"], "tp": 2}, "world_size": 3}, '{"cluster": {"gpus_per_node": 4}}',
     "the 1 vision ranks must be a multiple of llm tp=2"),
    ("batch", {}, '{"train": {"global_batch_size": 8}}', "train.global_batch_size is 8 but"),
])
def test_train_refuses_a_plan_it_cannot_run_before_starting_anything(tmp_path, capsys, name, change, settings,
                                                                      message):
    """`dflop train` (the launcher, outside torchrun) checks the plan against the config's model and
    cluster: one line, exit 2, no worker started, nothing written."""
    import yaml

    from dflop.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({**GOOD_PLAN, **change}))
    shapes = tmp_path / "shapes.parquet"
    shapes.write_bytes(b"")  # never read: the plan is refused first
    out = tmp_path / "train"
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--settings", settings, "--plan", str(plan), "--shapes", str(shapes), "--out-dir", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dflop train: ") and message in err, err
    assert not out.exists()


def test_checkpoints_follow_checkpoint_every_and_zero_turns_them_off():
    from dflop.runtime.run import checkpoint_due

    assert [d for d in range(1, 8) if checkpoint_due(d, 7, 3)] == [3, 6, 7]  # every 3, and the last
    assert [d for d in range(1, 5) if checkpoint_due(d, 4, 1)] == [1, 2, 3, 4]
    assert not any(checkpoint_due(d, 7, 0) for d in range(1, 8))  # benchmark runs: none, not even the last
