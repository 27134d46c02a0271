"""A rank builds only its own stages: the model stays on the meta device except the tensors its
stages reach, each with the values the whole model built in one process holds (random init by seed
and name, or a local safetensors directory read tensor by tensor), whatever the layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflop.models.weights_dir as weights_dir
from dflop.config import Config
from dflop.errors import UserError
from dflop.models.architectures import architecture
from dflop.models.builder import build_model
from dflop.models.handle import ModelHandle
from dflop.plan import plan_from_dict
from dflop.runtime.model import build_rank_modules, parameter_names
from dflop.runtime.topology import Topology

from trainer_reference import MODELS, config_dict
from gloo_ranks import run_ranks


def _plan(vision_layers: list[int], llm_layers: list[int], placement: str = "disjoint"):
    world = len(llm_layers) + (0 if placement == "colocated" else len(vision_layers))
    return plan_from_dict({"vision": {"tp": 1, "pp": len(vision_layers), "dp": 1, "layers_per_stage": vision_layers},
                           "llm": {"tp": 1, "pp": len(llm_layers), "dp": 1, "layers_per_stage": llm_layers},
                           "placement": placement, "microbatches": 1, "global_batch_size": 1,
                           "world_size": world}, "plan.yaml").plan


LAYOUTS = {"pp2-pp2": _plan([1, 1], [1, 1]), "colocated": _plan([2], [2], "colocated"),
           "vision-pp2-llm-pp1": _plan([1, 1], [2])}


def _handle(arch: str, weights: Path | None = None) -> ModelHandle:
    model = {"weights": str(weights)} if weights is not None else {}
    return ModelHandle.resolve(Config.from_dict(config_dict(arch, "unused.jsonl", model=model)).model)


def _rank_tensors(topo: Topology, handle: ModelHandle, seed: int = 0):
    """(modules, global name -> tensor of each parameter and buffer this rank holds)."""
    modules = build_rank_modules(topo, handle, seed=seed)
    names = parameter_names(modules)
    tensors = {names[id(p)]: p for p in modules.parameters()}
    buffers = {id(b): n for n, b in modules.full.named_buffers()}
    tensors.update({buffers[id(b)]: b for b in modules.buffers()})
    return modules, tensors


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_every_rank_of_every_layout_holds_the_whole_models_values(arch):
    # The whole model built in one process is the reference of the equivalence tests; each rank's
    # tensors (a layer under three splits, tied embeddings on two LLM stages, rotary buffers) equal it bitwise
    handle = _handle(arch)
    whole = build_model(arch, *MODELS[arch], seed=0)
    expected = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    seen = set()
    for plan in LAYOUTS.values():
        for rank in range(plan.world_size):
            _, tensors = _rank_tensors(Topology(plan, rank, plan.world_size), handle)
            for name, tensor in tensors.items():
                assert torch.equal(tensor, expected[name]), (plan, rank, name)
            seen |= set(tensors)
    assert seen >= set(dict(whole.named_parameters())) - {"model.vision_tower.post_layernorm.weight",
                                                          "model.vision_tower.post_layernorm.bias"}
    other = build_model(arch, *MODELS[arch], seed=1)
    assert not torch.equal(other.model.language_model.layers[1].mlp.up_proj.weight,
                           whole.model.language_model.layers[1].mlp.up_proj.weight)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_rank_materialises_only_the_tensors_its_stages_reach(layout):
    plan = LAYOUTS[layout]
    handle = _handle("llava_ov")
    untrained = {"model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"}
    for rank in range(plan.world_size):
        topo = Topology(plan, rank, plan.world_size)
        modules, tensors = _rank_tensors(topo, handle)
        mine = {id(t) for t in tensors.values()}
        real = {n: t for n, t in [*modules.full.named_parameters(), *modules.full.named_buffers()] if not t.is_meta}
        extra = {n for n, t in real.items() if id(t) not in mine}
        last_vision = topo.vision_role is not None and topo.vision_role.is_last
        assert extra == (untrained if last_vision else set()), (layout, rank)
        held = sum(t.numel() for t in modules.parameters())
        real_params = [t for n, t in modules.full.named_parameters() if not t.is_meta and n not in untrained]
        assert sum(t.numel() for t in real_params) == held


def _save(arch: str, out: Path, seed: int = 3, **kwargs) -> Path:
    """A Hugging Face directory of the tiny `arch` model (transformers' own save_pretrained)."""
    build_model(arch, *MODELS[arch], seed=seed).save_pretrained(out, **kwargs)
    return out


class _ReadLog:
    """safe_open that records the keys read (in place of dflop.models.weights_dir.safe_open)."""

    def __init__(self):
        self.keys: list[str] = []
        self._open = weights_dir.safe_open

    def __call__(self, *args, **kwargs):
        log, handle = self, self._open(*args, **kwargs)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_slice(self, key):
                return handle.get_slice(key)

            def get_tensor(self, key):
                log.keys.append(key)
                return handle.get_tensor(key)

        return Handle()


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("shards", [None, "40KB"], ids=["one-file", "sharded"])
def test_local_weights_load_only_the_ranks_tensors_as_transformers_loads_them(arch, shards, tmp_path, monkeypatch):
    path = _save(arch, tmp_path / "weights", **({"max_shard_size": shards} if shards else {}))
    if shards is not None:
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    model_class = architecture(arch).model_class
    reference = model_class.from_pretrained(path, local_files_only=True, use_safetensors=True)
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    handle = _handle(arch, path)
    plan = LAYOUTS["pp2-pp2"]
    stored = {k for f in path.glob("*.safetensors") for k in load_file(f)}
    read_by_rank = []
    for rank in range(plan.world_size):
        log = _ReadLog()
        monkeypatch.setattr(weights_dir, "safe_open", log)
        modules, tensors = _rank_tensors(Topology(plan, rank, plan.world_size), handle)
        for name, tensor in tensors.items():
            assert torch.equal(tensor, expected[name]), (rank, name)
        n_real = sum(1 for p in modules.full.parameters() if not p.is_meta)
        assert len(log.keys) == len(set(log.keys)) == n_real
        read_by_rank.append(set(log.keys))
    # each rank read its own share; together they read the file once over (the tied embedding twice)
    assert set().union(*read_by_rank) == stored
    assert sum(map(len, read_by_rank)) == len(stored) + (1 if arch == "llava_ov" else 0)


def test_a_tensor_missing_from_the_directory_is_named_in_one_line(tmp_path):
    path = _save("llava_ov", tmp_path / "weights")
    state = load_file(path / "model.safetensors")
    missing = "language_model.model.layers.1.mlp.up_proj.weight"
    del state[missing]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    handle, plan = _handle("llava_ov", path), LAYOUTS["pp2-pp2"]
    build_rank_modules(Topology(plan, 2, plan.world_size), handle, seed=0)  # LLM stage 0 does not need it
    with pytest.raises(UserError, match=r"^model\.weights: no file of .* holds tensor "
                                        r"model\.language_model\.layers\.1\.mlp\.up_proj\.weight "
                                        r"\(read model\.safetensors\)$"):
        build_rank_modules(Topology(plan, 3, plan.world_size), handle, seed=0)


def test_a_tensor_missing_from_its_indexed_shard_names_the_file(tmp_path):
    path = _save("llava_ov", tmp_path / "weights", max_shard_size="40KB")
    key = "language_model.model.layers.1.mlp.up_proj.weight"
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    state = load_file(path / shard)
    del state[key]
    save_file(state, path / shard, metadata={"format": "pt"})
    plan = LAYOUTS["pp2-pp2"]
    with pytest.raises(UserError, match=rf"^model\.weights: tensor model\.language_model\.layers\.1\.mlp\.up_proj"
                                        rf"\.weight is missing from .*{shard} \(where model\.safetensors\.index\.json "
                                        rf"puts it\)$"):
        build_rank_modules(Topology(plan, 3, plan.world_size), _handle("llava_ov", path), seed=0)


def test_a_directory_without_safetensors_is_refused(tmp_path):
    path = _save("llava_ov", tmp_path / "weights")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"has no \*\.safetensors files \(pickled checkpoints are not loaded\)$"):
        build_rank_modules(Topology(LAYOUTS["colocated"], 0, 1), _handle("llava_ov", path), seed=0)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_last_stage_with_a_tied_head_holds_no_whole_embedding_table(tmp_path):
    # tp = 2, LLM pp = 2 (4 ranks): LLaVA-OV's head is tied to the token embedding, which only the
    # first LLM stage runs; the last stage's ranks shard the head and must not keep the full model's
    # whole [V, d] table behind it
    worker = Path(__file__).with_name("rank_build_worker.py")
    run_ranks(worker, tmp_path, "llava_ov", "2", nproc=4, timeout=600)
    for r in range(4):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report["beyond"] == {} and report["differ"] == [], r


@pytest.mark.distributed
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_tensor_parallel_ranks_hold_only_their_shards(arch, tmp_path):
    # tp = 2 over the whole model (colocated; LLaVA-OV's tied embedding and head on one stage): each
    # rank's full model registers no real tensor beyond its own shards, whose gathered values are the
    # whole model's
    worker = Path(__file__).with_name("rank_build_worker.py")
    run_ranks(worker, tmp_path, arch, nproc=2, timeout=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["beyond"] == {} and report["differ"] == []
        assert report["held"] < 0.6 * report["whole"]  # half of each sharded matrix, norms and biases replicated
