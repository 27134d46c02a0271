"""Checkpoints: exact round trip, kill-and-resume, atomicity (half-written checkpoints ignored),
keep-last-k, safe loading, and the global names of pipeline / tensor-parallel parameters.

References are independent of the checkpoint code: the state captured in memory right after the
save (round trip), an uninterrupted run of the same loop (resume), and the full model the shards
were cut from (read-back of sharded checkpoints).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from dflop.errors import UserError
from dflop.models.builder import build_model
from dflop.models.stages import build_llm_stage
from dflop.runtime.checkpoint import (
    TrainState,
    complete_checkpoints,
    load_latest,
    read_checkpoint_model,
    save_checkpoint,
    step_dir,
)
from dflop.runtime.param_names import global_name_module, rank_parameters
from dflop.runtime.safe_dcp import SafeFileSystemReader, TensorOnlyLoadPlanner
from test_checkpoint_helpers import (
    INTERNVL,
    LAYOUTS,
    LLAVA,
    LLAVA_UNTRAINED,
    fake_steps,
    make_state,
    perturbed_weights,
    pipeline_layout,
    run_toy_training,
    tensor_parallel_layout,
    spawn,
)

torch.set_num_threads(1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _snapshot(state: TrainState) -> dict:
    """Everything a resume must restore, copied, plus the next random numbers of every RNG."""
    opt = state.optimizer
    snap = {
        "params": {n: _local(t).detach().clone() for n, t in state.params.tensors.items()},
        "optim": [{k: (_local(v).clone(), isinstance(v, DTensor)) if torch.is_tensor(v) else v
                   for k, v in opt.state[p].items()}
                  for g in opt.param_groups for p in g["params"]],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "sched": state.lr_scheduler.state_dict(),
        "lr": state.lr_scheduler.get_last_lr(),
        "data_seed": state.data_seed,
        "extra": json.loads(json.dumps(state.extra)),
    }
    return snap


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


def _assert_restored(state: TrainState, snap: dict, draws: tuple) -> None:
    for name, tensor in state.params.tensors.items():
        assert torch.equal(_local(tensor), snap["params"][name]), name
    opt = state.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    for param, saved in zip(params, snap["optim"]):
        got = opt.state[param]
        assert set(got) == set(saved)
        for key, value in saved.items():
            if isinstance(value, tuple):
                local, was_dtensor = value
                assert torch.equal(_local(got[key]), local), key
                assert isinstance(got[key], DTensor) == was_dtensor, key
            else:
                assert got[key] == value
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == snap["groups"]
    assert state.lr_scheduler.state_dict() == snap["sched"]
    assert state.lr_scheduler.get_last_lr() == snap["lr"]
    assert state.data_seed == snap["data_seed"] and state.extra == snap["extra"]
    again = _draws()
    assert again[:2] == draws[:2] and torch.equal(again[2], draws[2])


def _round_trip(state: TrainState, root: Path, step: int) -> None:
    """Save, change every part of the state, load: everything is back, in place and in a fresh
    optimizer + scheduler."""
    fake_steps(state.params, state.optimizer, state.lr_scheduler, n=3, salt=1)
    state.extra.update({"correction": [1.25, 0.5]})
    save_checkpoint(root, step, state)
    snap, draws = _snapshot(state), _draws()

    fake_steps(state.params, state.optimizer, state.lr_scheduler, n=2, salt=2)
    state.data_seed, state.extra["correction"] = 99, [9.0]
    torch.manual_seed(12345), random.seed(12345), np.random.seed(12345)
    assert load_latest(root, state) == step
    _assert_restored(state, snap, draws)

    fresh = make_state(state.params)  # a restarted process: no optimizer state yet
    fake_steps(state.params, state.optimizer, state.lr_scheduler, n=1, salt=3)
    assert load_latest(root, fresh) == step
    _assert_restored(fresh, snap, draws)


# --------------------------------------------------------------------------------------------------
# One process, no process group
# --------------------------------------------------------------------------------------------------


def test_round_trip_restores_everything(tmp_path):
    layout = pipeline_layout(0, 1)
    _round_trip(make_state(layout.params, data_seed=5), tmp_path / "ckpt", step=3)


def test_kill_right_after_a_checkpoint_and_resume_matches_uninterrupted_run(tmp_path):
    expected = run_toy_training(tmp_path / "a", total_steps=6)
    run_toy_training(tmp_path / "b", total_steps=6, stop_after=4)
    assert [s for s, _ in complete_checkpoints(tmp_path / "b")] == [2, 4]
    resumed = run_toy_training(tmp_path / "b", total_steps=6)
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name


def test_kill_between_checkpoints_redoes_the_lost_steps(tmp_path):
    expected = run_toy_training(tmp_path / "a", total_steps=6)
    run_toy_training(tmp_path / "b", total_steps=6, stop_after=5)  # step 5 is lost: resume from 4
    resumed = run_toy_training(tmp_path / "b", total_steps=6)
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name


def test_resume_test_detects_a_lost_rng_state(tmp_path):
    """The loop's equality is a real check: resuming with the RNG reseeded differs."""
    expected = run_toy_training(tmp_path / "a", total_steps=4)
    run_toy_training(tmp_path / "b", total_steps=4, stop_after=2)
    other_stream = base64.b64encode(torch.Generator().manual_seed(4242).get_state().numpy().tobytes()).decode()
    for path in (tmp_path / "b").glob("step_*/rank_*.json"):
        data = json.loads(path.read_text())
        data["rng"]["torch"] = other_stream
        path.write_text(json.dumps(data))
    resumed = run_toy_training(tmp_path / "b", total_steps=4)
    assert any(not torch.equal(resumed[n], v) for n, v in expected.items())


def test_rng_state_saves_and_restores_only_this_ranks_cuda_device(monkeypatch):
    """A fake CUDA API with 4 visible devices, this rank on device 2: the checkpoint holds device 2's
    generator alone and restores it there (touching every device would create a CUDA context on
    each); a checkpoint that holds every device's state restores this rank's entry."""
    from dflop.runtime.checkpoint_parts import RNGState

    states = {d: torch.full((16,), 10 + d, dtype=torch.uint8) for d in range(4)}
    restored = []

    def every_device(*args, **kwargs):
        raise AssertionError("the RNG state touched every visible CUDA device")

    for name, value in {"is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: 4,
                        "current_device": lambda: 2, "get_rng_state": lambda device: states[device].clone(),
                        "set_rng_state": lambda state, device: restored.append((device, state.tolist())),
                        "get_rng_state_all": every_device, "set_rng_state_all": every_device}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    saved = RNGState().state_dict()
    assert saved["cuda"] == [base64.b64encode(states[2].numpy().tobytes()).decode()]
    RNGState().load_state_dict(json.loads(json.dumps(saved)))
    assert restored == [(2, [12] * 16)]
    restored.clear()
    every = [base64.b64encode(states[d].numpy().tobytes()).decode() for d in range(4)]
    RNGState().load_state_dict({**saved, "cuda": every})
    assert restored == [(2, [12] * 16)]
    with pytest.raises(UserError, match="for 3 CUDA devices"):
        RNGState().load_state_dict({**saved, "cuda": every[:3]})


def _small_state() -> TrainState:
    model = build_model(*LLAVA, seed=0)
    return make_state(rank_parameters(model))


def test_half_written_checkpoints_are_ignored(tmp_path):
    root = tmp_path / "ckpt"
    state = _small_state()
    fake_steps(state.params, state.optimizer, state.lr_scheduler, n=1, salt=1)
    save_checkpoint(root, 2, state)
    snap, draws = _snapshot(state), _draws()
    fake_steps(state.params, state.optimizer, state.lr_scheduler, n=1, salt=2)
    save_checkpoint(root, 4, state, keep=3)
    save_checkpoint(root, 6, state, keep=3)
    # a run killed before the marker (renamed by hand) and one killed before the rename
    (step_dir(root, 4) / "COMPLETE").unlink()
    step_dir(root, 6).rename(root / "step_000006.tmp")
    (root / "step_000006.tmp" / "COMPLETE").unlink()

    assert [s for s, _ in complete_checkpoints(root)] == [2]
    fake_steps(state.params, state.optimizer, state.lr_scheduler, n=1, salt=3)
    assert load_latest(root, state) == 2
    _assert_restored(state, snap, draws)
    save_checkpoint(root, 3, state, keep=5)  # the next save clears the stale .tmp
    assert not (root / "step_000006.tmp").exists()


def test_keep_last_k_and_resaving_a_step(tmp_path):
    root = tmp_path / "ckpt"
    state = _small_state()
    for step in range(1, 6):
        save_checkpoint(root, step, state, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000005"]
    save_checkpoint(root, 5, state, keep=2)  # a re-run saving the same step replaces it
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000005"]
    save_checkpoint(root, 6, state, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_000006"]
    save_checkpoint(root, 3, state, keep=1)  # an older step saved later is never pruned right away
    assert sorted(p.name for p in root.iterdir()) == ["step_000003"]
    with pytest.raises(UserError, match="keep must be at least 1"):
        save_checkpoint(root, 7, state, keep=0)


def test_no_checkpoint_leaves_state_untouched(tmp_path):
    state = _small_state()
    before = {n: t.clone() for n, t in state.params.tensors.items()}
    assert load_latest(tmp_path / "missing", state) is None
    (tmp_path / "empty" / "step_000001.tmp").mkdir(parents=True)
    assert load_latest(tmp_path / "empty", state) is None
    assert all(torch.equal(before[n], t) for n, t in state.params.tensors.items())


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_with_foreign_pickle_globals_is_refused_unexecuted(tmp_path):
    root = tmp_path / "ckpt"
    state = _small_state()
    save_checkpoint(root, 1, state)
    exploit = _Exploit()
    exploit.marker = tmp_path / "pwned"
    (step_dir(root, 1) / ".metadata").write_bytes(pickle.dumps(exploit))
    with pytest.raises(UserError, match=r"\.metadata is not DCP metadata: global posix\.system is not allowed"):
        load_latest(root, state)
    assert not exploit.marker.exists()


def test_mismatches_are_one_line_errors(tmp_path):
    root = tmp_path / "ckpt"
    state = _small_state()
    save_checkpoint(root, 1, state)

    meta = step_dir(root, 1) / "train_state.json"
    data = json.loads(meta.read_text())
    meta.write_text(json.dumps({**data, "world_size": 2}))
    with pytest.raises(UserError, match="written by 2 ranks; this run has 1"):
        load_latest(root, state)
    meta.write_text("{")
    with pytest.raises(UserError, match=r"train_state\.json is not valid JSON"):
        load_latest(root, state)
    meta.write_text(json.dumps({k: v for k, v in data.items() if k != "data_seed"}))
    with pytest.raises(UserError, match=r"train_state\.json has no 'data_seed' entry"):
        load_latest(root, state)
    meta.write_text(json.dumps(data))

    other = make_state(rank_parameters(build_model(*INTERNVL, seed=0)))
    with pytest.raises(UserError, match=r"has no tensor 'model\.model\.vision_tower\.embeddings\.cls_token'"):
        load_latest(root, other)

    stray = torch.nn.Parameter(torch.zeros(3))
    bad = TrainState(state.params, torch.optim.AdamW([stray]))
    with pytest.raises(UserError, match="optimizer parameter 0 of group 0 .* is not among this rank's parameters"):
        save_checkpoint(root, 2, bad)


def test_global_names_of_pipeline_stages_and_untrained_parameters():
    model = build_model(*LLAVA, seed=0)
    last = build_llm_stage(model, 1, 2)
    params = rank_parameters(model, [last])
    # layer 0 of stage 1 is the model's layer 1; the tied head is the embedding
    assert "model.language_model.layers.1.self_attn.q_proj.weight" in params.tensors
    assert not any(".layers.0." in n for n in params.tensors)
    assert params.tensors["model.language_model.embed_tokens.weight"] is model.lm_head.weight
    assert set(params.untrained) == LLAVA_UNTRAINED


def _dcp_tensor(path: Path, key: str, like: torch.Tensor) -> torch.Tensor:
    """One tensor as the checkpoint's DCP files hold it."""
    out = {key: torch.empty_like(like)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's warning about loading in one process
        dcp.load(out, storage_reader=SafeFileSystemReader(path), planner=TensorOnlyLoadPlanner(), no_dist=True)
    return out[key]


def test_optimizer_state_is_keyed_by_global_names_through_the_state_dict_api(tmp_path):
    """A pipeline stage's optimizer state goes in under the full model's names (its local layer 0 is
    the model's layer 1), as torch's get_optimizer_state_dict flattens it; DCP holds only tensors,
    the optimizer settings are JSON."""
    model = build_model(*LLAVA, seed=0)
    last = build_llm_stage(model, 1, 2)
    state = make_state(rank_parameters(model, [last]))
    fake_steps(state.params, state.optimizer, state.lr_scheduler, n=2, salt=1)
    path = save_checkpoint(tmp_path, 2, state)

    metadata = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    assert all(isinstance(meta, TensorStorageMetadata) for meta in metadata.values())  # nothing pickled
    library = get_optimizer_state_dict(global_name_module(state.params.tensors), state.optimizer,
                                       options=StateDictOptions(flatten_optimizer_state_dict=True))
    tensors = {f"optimizer.{k}" for k, v in library.items() if torch.is_tensor(v)}
    assert {k for k in metadata if k.startswith("optimizer.")} == tensors
    settings = json.loads((path / "rank_00000.json").read_text())["optimizer"]
    assert settings == json.loads(json.dumps({k: v for k, v in library.items() if not torch.is_tensor(v)}))

    local = last.layers[0].mlp.up_proj.weight
    exp_avg = state.optimizer.state[local]["exp_avg"]
    key = "optimizer.state.model.language_model.layers.1.mlp.up_proj.weight.exp_avg"
    assert torch.equal(_dcp_tensor(path, key, exp_avg), exp_avg)
    assert not any(".layers.0." in k for k in metadata)


def test_parameters_never_stepped_keep_no_optimizer_state(tmp_path):
    """Saving never steps an optimizer (AdamW counts steps per parameter), and a parameter without
    optimizer state (no gradient yet) has none after a load either."""
    layout = pipeline_layout(0, 1)
    state = make_state(layout.params)
    save_checkpoint(tmp_path, 0, state, keep=5)
    assert not any(state.optimizer.state.values())

    llm = {n for n in state.params.tensors if n.startswith("model.language_model.")}
    for name, param in state.params.tensors.items():
        param.grad = torch.ones_like(param) if name in llm else None
    state.optimizer.step()
    state.optimizer.zero_grad()
    save_checkpoint(tmp_path, 1, state, keep=5)
    fresh = make_state(state.params)
    assert load_latest(tmp_path, fresh) == 1
    for name, param in state.params.tensors.items():
        got = fresh.optimizer.state[param]
        assert (set(got) == {"step", "exp_avg", "exp_avg_sq"}) if name in llm else not got, name
        for key, value in got.items():
            assert torch.equal(value, state.optimizer.state[param][key]), (name, key)


def test_a_checkpoint_of_the_previous_format_is_refused_in_one_line(tmp_path):
    state = _small_state()
    path = save_checkpoint(tmp_path, 1, state)
    record = json.loads((path / "train_state.json").read_text())
    (path / "train_state.json").write_text(json.dumps({**record, "format": 2}))
    with pytest.raises(UserError, match=r"step_000001 is of an older format \(2; this dflop reads format 3\)"):
        load_latest(tmp_path, state)


def test_a_plain_tensor_parallel_shard_is_refused():
    """Tensor-parallel shards are DTensors (their shape is the global one); a plain tensor cut to a
    slice cannot be named in a checkpoint."""
    model = build_model(*INTERNVL, seed=0)
    stage = build_llm_stage(model, 0, 1)
    proj = stage.layers[0].self_attn.q_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().chunk(2, 0)[1].clone())
    with pytest.raises(UserError, match=r"q_proj.weight: shape \[32, 64\] is not the full model's \[64, 64\] "
                                        r"\(tensor-parallel shards must be DTensors\)"):
        rank_parameters(model, [stage])


# --------------------------------------------------------------------------------------------------
# Several processes (gloo)
# --------------------------------------------------------------------------------------------------


def _distributed_round_trips(rank: int, tmp: str) -> None:
    for kind, make in LAYOUTS.items():
        layout = make(rank, 2)
        root = Path(tmp) / kind
        state = make_state(layout.params, data_seed=5)
        save_checkpoint(root, 0, state, keep=5)  # the untouched shards: read back below
        _round_trip(state, root, step=3)
        if rank == 0:
            full = read_checkpoint_model(step_dir(root, 0))
            save_file({n: t.contiguous() for n, t in full.items()}, str(Path(tmp) / f"{kind}_step0.safetensors"))


@pytest.mark.distributed
def test_round_trip_across_pipeline_stages_tp_shards_and_dtensors(tmp_path):
    spawn(_distributed_round_trips, 2, tmp_path, str(tmp_path))
    for kind in LAYOUTS:
        spec = INTERNVL if kind == "tensor_parallel" else LLAVA
        reference = perturbed_weights(spec)  # the full model every rank cut its share from
        full = load_file(str(tmp_path / f"{kind}_step0.safetensors"))
        assert set(full) == set(reference) - (LLAVA_UNTRAINED if spec == LLAVA else set()), kind
        for name, tensor in full.items():
            assert torch.equal(tensor, reference[name]), (kind, name)


def _distributed_toy_runs(rank: int, tmp: str, phase: str) -> None:
    root = Path(tmp)
    if phase == "first":
        final = run_toy_training(root / "uninterrupted", total_steps=6)
        save_file(final, str(root / f"uninterrupted_{rank}.safetensors"))
        run_toy_training(root / "killed", total_steps=6, stop_after=4)
    else:
        final = run_toy_training(root / "killed", total_steps=6)
        save_file(final, str(root / f"resumed_{rank}.safetensors"))


@pytest.mark.distributed
def test_kill_and_resume_with_two_data_parallel_ranks(tmp_path):
    spawn(_distributed_toy_runs, 2, tmp_path, str(tmp_path), "first")
    spawn(_distributed_toy_runs, 2, tmp_path, str(tmp_path), "resume")  # fresh processes
    for rank in (0, 1):
        expected = load_file(str(tmp_path / f"uninterrupted_{rank}.safetensors"))
        resumed = load_file(str(tmp_path / f"resumed_{rank}.safetensors"))
        for name, value in expected.items():
            assert torch.equal(resumed[name], value), (rank, name)
    # the replicas saved their tensors once; each rank its own RNG file
    ckpt = step_dir(tmp_path / "killed", 6)
    assert sorted(p.name for p in ckpt.glob("rank_*.json")) == ["rank_00000.json", "rank_00001.json"]
    rng = [json.loads((ckpt / f"rank_0000{r}.json").read_text())["rng"]["torch"] for r in (0, 1)]
    assert rng[0] != rng[1]


def _tp_groups_with_replicas(rank: int, tmp: str) -> None:
    layout = tensor_parallel_layout(rank, 4, tp_size=2, sequence_parallel=True)
    root = Path(tmp) / "ckpt"
    state = make_state(layout.params, data_seed=5)
    save_checkpoint(root, 0, state, keep=5)
    _round_trip(state, root, step=3)
    if rank == 0:
        full = read_checkpoint_model(step_dir(root, 0))
        save_file({n: t.contiguous() for n, t in full.items()}, str(Path(tmp) / "step0.safetensors"))


@pytest.mark.distributed
def test_round_trip_with_tp_subgroups_and_data_parallel_replicas(tmp_path):
    """4 ranks: TP groups {0, 1} and {2, 3} hold the same shards (two DP replicas); sequence
    parallelism makes the LLM's norm weights replicated DTensors."""
    spawn(_tp_groups_with_replicas, 4, tmp_path, str(tmp_path))
    reference = perturbed_weights(INTERNVL)
    full = load_file(str(tmp_path / "step0.safetensors"))
    assert set(full) == set(reference)
    for name, tensor in full.items():
        assert torch.equal(tensor, reference[name]), name
