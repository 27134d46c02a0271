"""shard_optimizer (FSDP2, ZeRO-2): the cost model's state bytes and the step pricing in closed form,
the (dp, tp) rank grid a sharded tensor-parallel stage gets, and the state bytes a rank really holds
against the cost model.

The gradients and steps themselves are checked elsewhere: test_pipeline_equivalence.py (every
gradient vs transformers' single-process model) and test_trainer_loop.py (4 steps and a resume vs
the unsharded trainer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from dflop.config import Config
from dflop.costmodel.analytic import analytic_cost_model
from dflop.costmodel.memory import training_state_bytes
from dflop.errors import UserError
from dflop.runtime.process_group import end_worker
from dflop.models.handle import ModelHandle
from dflop.models.tensor_parallel import TPGroup
from dflop.plan import Layout, Plan, Techniques, plan_from_dict
from dflop.pricing.cluster import Cluster
from dflop.pricing.pricing import Pricing
from dflop.runtime.topology import Topology
from gloo_ranks import run_ranks
from trainer_reference import config_dict

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sharding.py"


@pytest.mark.parametrize("dtype, dp, expected", [("float32", 1, (4, 4, 8)), ("float32", 2, (6, 4, 4)),
                                                 ("float32", 8, (4.5, 4, 1)), ("bfloat16", 4, (5, 4, 2))])
def test_state_bytes_per_parameter_sharded(dtype, dp, expected):
    # param: gathered copy + 1/dp shard; grad: the full accumulation; optimizer: 1/dp (bfloat16: the
    # same float32 state, dflop.models.precision)
    b = training_state_bytes(dtype, shard_over=dp)
    assert (b.param, b.grad, b.optimizer) == pytest.approx(expected)
    with pytest.raises(UserError):
        training_state_bytes(dtype, shard_over=0)


def test_sharded_stage_priced_as_all_gather_plus_reduce_scatter():
    model = ModelHandle.resolve(Config.from_dict({"model": {"arch": "llava_ov", "vision": "siglip-tiny",
                                                            "llm": "qwen2.5-tiny"}}).model)
    cost = analytic_cost_model(model.config, tp_degrees=[1], dtype="float32", preset=model.spec.preset)
    cluster = Cluster.from_section(Config.from_dict({"model": {"arch": "llava_ov", "vision": "siglip-tiny",
                                                               "llm": "qwen2.5-tiny"},
                                                     "cluster": {"gpus_per_node": 2, "inter_node_gbps": 10}}).cluster)
    plan = Plan.uniform(Layout("disjoint", 1, 1, 4, 1, 2, 4, 4), model.n_vision_layers, model.n_llm_layers)
    plain = Pricing.of(plan, cost, model, cluster)
    sharded_llm = plan.with_techniques(Techniques.off(1), Techniques(("none", "none"), shard_optimizer=True))
    sharded = Pricing.of(sharded_llm, cost, model, cluster)
    stage = cost.llm_stage_terms([1], n_layers=plan.llm_layers[0], first=True, last=False, tp=1).static
    dp, bw, lat = 4, cluster.bandwidth(sharded._links.llm_allreduce_intra), cluster.p2p_latency_s
    # ring all-gather of the parameters + ring reduce-scatter of the gradients, plus (both plans) the
    # tied embedding's sum over the first and last LLM stage: a 2-rank ring of the table's float32
    # gradient, across nodes (12 ranks on nodes of 2)
    text = model.config.get_text_config()
    table = text.vocab_size * text.hidden_size * 4
    tied = 2 * (1 / 2) * table / cluster.bandwidth(False) + 2 * lat
    expected = (dp - 1) / dp * (stage.param_bytes + stage.grad_bytes) / bw + 2 * (dp - 1) * lat + tied
    assert sharded.allreduce_s[1] == pytest.approx(expected)
    assert sharded.allreduce_s[0] == plain.allreduce_s[0]  # vision not sharded: its all-reduce
    # float32 everywhere: the same bytes as the all-reduce (2 (dp-1)/dp x grads)
    np.testing.assert_allclose(sharded.allreduce_s, plain.allreduce_s)


def test_a_sharded_tensor_parallel_stage_gets_its_dp_by_tp_rank_grid():
    """With tp > 1 a sharded module's TP group carries the stage's ranks [replica][tp rank] (the
    2-D mesh FSDP2 shards over); an unsharded one keeps the plain 1-D group."""
    raw = {"vision": {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2]},
           "llm": {"tp": 2, "pp": 2, "dp": 2, "layers_per_stage": [1, 1], "shard_optimizer": True,
                   "sequence_parallel": True},
           "placement": "disjoint", "microbatches": 2, "global_batch_size": 8, "world_size": 10}
    plan = plan_from_dict(raw, "p.yaml").plan
    topo = Topology(plan, 9, 10)  # LLM stage 1, replica 1, tp rank 1: ranks 2 + (1 * 2 + r) * 2 + t
    topo.groups.llm_tp, topo.groups.llm_dp = "tp group", "dp group"  # stand-ins: no process groups here
    assert topo.llm_tp == TPGroup(1, 2, "tp group", "dp group", ((6, 7), (8, 9)))
    unsharded = Topology(plan.with_techniques(plan.vision_techniques, Techniques(("none", "none"))), 9, 10)
    unsharded.groups.llm_tp, unsharded.groups.llm_dp = "tp group", "dp group"
    assert unsharded.llm_tp == TPGroup(1, 2, "tp group")


@pytest.mark.distributed
@pytest.mark.slow
def test_held_state_bytes_match_the_cost_model(tmp_path, runtime_demo, demo_shapes, monkeypatch, capsys):
    """Per rank, at the step's peak and between steps, sharded and not: bytes of parameter,
    gradient and optimizer-state storages within 5 % of n_params x training_state_bytes.

    `benchmarks/bench_sharding.py` as its command line runs it (``--preset tiny --steps 1 --samples
    60``), but on the session's demo data (the same 60 samples, seed 0, and their tiny-preset shapes,
    where the benchmark's `prepare` reuses them) and with its ranks forked by `run_ranks` instead
    of started by torchrun (fresh interpreters importing torch and transformers, and converting the
    tokenizer, cost most of the run: torchrun itself is covered by the `dflop train` tests)."""
    import bench_sharding
    import bench_trainer

    (tmp_path / "demo").symlink_to(Path(runtime_demo).parent, target_is_directory=True)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "shapes.parquet").symlink_to(demo_shapes["llava_ov"])
    assert bench_trainer.model_section("tiny") == config_dict("llava_ov", runtime_demo)["model"]
    launched = []

    def fork_ranks(script, spec, world):
        launched.append(world)
        run_ranks(script, "--worker", spec, nproc=world, timeout=600)

    monkeypatch.setattr(bench_trainer, "launch_workers", fork_ranks)
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--preset", "tiny", "--steps", "1", "--samples", "60",
                                      "--out-dir", str(tmp_path)])
    assert bench_sharding.main() == 0 and launched == [2]
    assert "| sharded | 1 |" in capsys.readouterr().out  # the summary table
    rows = [r for r in json.loads((tmp_path / "result.json").read_text())["rows"] if not r["warmup"]]
    assert {r["variant"] for r in rows} == {"sharded", "unsharded"} and len(rows) == 4
    for r in rows:
        assert r["peak_bytes"] == pytest.approx(r["predicted_peak"], rel=0.05), r
        assert r["between_bytes"] == pytest.approx(r["predicted_between"], rel=0.05), r
    between = {(r["variant"], r["rank"]): r["between_bytes"] for r in rows}
    for rank in (0, 1):  # dp = 2: between steps a sharded rank holds about half the state
        assert between["sharded", rank] < 0.55 * between["unsharded", rank]


def _idle_replica_worker(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from dflop.runtime.sharding import StepSharding, sum_over_replicas

    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    group = dist.new_group([0, 1])
    sharded = fully_shard(stage, mesh=DeviceMesh.from_group(group, "cpu"), reshard_after_forward=False)
    sum_over_replicas(sharded)
    step = StepSharding([sharded])
    for _ in range(2):  # two steps: the second starts from the first's state
        for p in stage.parameters():  # the sharded ones between steps; the trainer does the same
            p.grad = None
        step.begin()
        if rank == 0:  # replica 1 has no work at all this step (an empty share on every microbatch)
            for k in range(3):
                (stage(torch.full((2, 4), 0.1 * (k + 1))) ** 2).sum().backward()
        step.reduce()
    torch.save({n: (p.grad.to_local(), p.grad.placements[0].dim) for n, p in stage.named_parameters()},
               f"{out}/rank{rank}.pt")


@pytest.mark.distributed
def test_a_replica_without_work_takes_part_in_the_reduction(tmp_path):
    """Replica 0 runs three microbatches, replica 1 none: both end with their shard of replica 0's
    accumulated gradient (the plain model's, in one process), no collective left unmatched."""
    import torch
    from torch import nn

    from test_checkpoint_helpers import spawn

    spawn(_idle_replica_worker, 2, tmp_path, str(tmp_path))  # forked ranks, ended by `end_worker`
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    for k in range(3):
        (ref(torch.full((2, 4), 0.1 * (k + 1))) ** 2).sum().backward()
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, p in ref.named_parameters():
        (a, dim), (b, _) = shards[0][name], shards[1][name]
        torch.testing.assert_close(torch.cat([a, b], dim), p.grad, msg=name)


@pytest.fixture
def one_rank_world():
    """A gloo world of this process alone (FSDP2 over one replica: the reduce-scatter is a copy)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _half_used_stage():
    """Two linear layers, of which forward uses the first only."""
    import torch
    from torch import nn

    class HalfUsed(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    return HalfUsed()


def _one_rank_sharded(group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from dflop.runtime.sharding import sum_over_replicas

    stage = _half_used_stage()
    sharded = fully_shard(stage, mesh=DeviceMesh.from_group(group, "cpu"), reshard_after_forward=False)
    sum_over_replicas(sharded)
    return stage, sharded


def test_fsdp2_private_state_is_the_one_read(one_rank_world):
    """`dflop.runtime.sharding` reads FSDP2's private state, as read in torch 2.11 and 2.13: one
    `_fsdp_param_group` (or None) before 2.13, a list `_fsdp_param_groups` since. Fails when the
    installed torch keeps it otherwise (read its FSDP2 sources and `perform_reduce_grad`, then
    update `_param_groups`)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from dflop.runtime import sharding

    stage, sharded = _one_rank_sharded(one_rank_world)
    state = fully_shard.state(sharded)
    sharding._lazy_init(sharded)
    assert state._state_ctx.all_states == [state]
    if "_fsdp_param_groups" in vars(state):  # torch 2.13
        held = state.__dict__["_fsdp_param_groups"]
        assert isinstance(held, list) and len(held) == 1
    else:  # torch 2.11
        assert "_fsdp_param_groups" not in dir(state)
        held = [state.__dict__["_fsdp_param_group"]]
    assert isinstance(held[0], FSDPParamGroup)
    assert sharding._param_groups(state) == held
    assert {id(p.sharded_param) for p in held[0].fsdp_params} == {id(p) for p in stage.parameters()}
    assert callable(held[0].post_backward) and callable(state._root_post_backward_final_callback)


def test_a_parameter_without_a_gradient_is_reduced_as_zero(one_rank_world):
    """A parameter that got no gradient this step ends with a zero gradient shard, not None (torch
    2.11 leaves it out of the reduce-scatter unless it has one, which with dp > 1 would pair
    different calls, or none, on the replicas); the used one's is the plain model's."""
    import torch

    from dflop.runtime.sharding import StepSharding

    stage, sharded = _one_rank_sharded(one_rank_world)
    ref = _half_used_stage()
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    step = StepSharding([sharded])
    step.begin()
    (stage(x) ** 2).sum().backward()
    step.reduce()
    (ref(x) ** 2).sum().backward()
    for name, p in stage.named_parameters():
        assert p.grad is not None, name
        expected = ref.get_parameter(name).grad
        expected = torch.zeros_like(p.grad.to_local()) if expected is None else expected
        torch.testing.assert_close(p.grad.to_local(), expected, msg=name)
