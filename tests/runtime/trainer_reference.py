"""The single-process reference: transformers' own model forward on each sample of a global batch.

The unsplit HF model (``LlavaOnevisionForConditionalGeneration`` / ``InternVLForConditionalGeneration``,
plain SDPA attention, same seed as the trainer) runs every sample on its own, in the processor's
input format (LLaVA-OV: ``pixel_values`` [images, tiles, 3, S, S] + ``image_sizes`` +
``batch_num_images``, videos as ``pixel_values_videos``; InternVL: tiles [n, 3, S, S]) with
``labels``; its mean loss times the sample's target count gives the sample's loss sum. The batch
loss is the total over the total target count, and its backward gives the reference gradients.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflop.data.training import IMAGE, VIDEO, TrainingData
from dflop.models.builder import build_model

MODELS = {"llava_ov": ("siglip-tiny", "qwen2.5-tiny"), "internvl": ("internvit-tiny", "llama3-tiny")}


# The smallest pipeline: the vision tower on rank 0, the LLM on rank 1; two microbatches of a
# 4-sample global batch.
TWO_RANK_PLAN = ("vision: {tp: 1, pp: 1, dp: 1, layers_per_stage: [2]}\n"
                 "llm: {tp: 1, pp: 1, dp: 1, layers_per_stage: [2]}\n"
                 "placement: disjoint\nmicrobatches: 2\nglobal_batch_size: 4\nworld_size: 2\n")


def config_dict(arch: str, manifest, **sections) -> dict:
    """A config (dflop.config sections) for the tiny model of `arch` on the dataset `manifest`."""
    vision, llm = MODELS[arch]
    raw = {"model": {"arch": arch, "vision": vision, "llm": llm},
           "data": {"datasets": [{"name": "demo", "path": str(manifest)}]}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def pick_pool(shapes_path, path, per_modality: dict[str, int]) -> str:
    """Write a shapes.parquet with the first `n` samples of each modality; returns its path."""
    import pandas as pd

    shapes = pd.read_parquet(shapes_path)
    parts = [shapes[shapes["modality"] == m].head(n) for m, n in per_modality.items()]
    pd.concat(parts).to_parquet(path, index=False)
    return str(path)


def reference_gradients(arch: str, vision: str, llm: str, data: TrainingData, rows, seed: int = 0,
                        freeze: tuple[str, ...] = ()):
    """(loss, answer tokens, {name: grad}) of the mean answer-token loss over samples `rows`."""
    model = build_model(arch, vision, llm, seed=seed, llm_attention="sdpa")
    prefixes = {"vision": ("model.vision_tower.",), "projector": ("model.multi_modal_projector.", "model.image_newline"),
                "llm": ("model.language_model.", "lm_head.")}
    frozen = tuple(p for part in freeze for p in prefixes[part])
    for name, param in model.named_parameters():
        param.requires_grad_(not (frozen and name.startswith(frozen)))
    total, count = 0.0, 0
    for row in rows:
        sample = data[row]
        ids, labels = sample.input_ids[None], sample.labels[None]
        n_targets = int((labels[0, 1:] != -100).sum())
        kwargs = dict(input_ids=ids, labels=labels, use_cache=False)
        media = sample.layout.media
        images = [m for m in media if m.kind == IMAGE]
        videos = [m for m in media if m.kind == VIDEO]
        if arch == "internvl":
            if media:
                kwargs["pixel_values"] = sample.pixels
        else:
            start = 0
            if images:
                most = max(m.n_tiles for m in images)
                stacked = torch.zeros(len(images), most, *sample.pixels.shape[1:])
                for k, m in enumerate(images):
                    stacked[k, :m.n_tiles] = sample.pixels[start:start + m.n_tiles]
                    start += m.n_tiles
                kwargs.update(pixel_values=stacked, image_sizes=torch.tensor([m.size_hw for m in images]),
                              batch_num_images=torch.tensor([len(images)]))
            if videos:
                (video,) = videos
                kwargs["pixel_values_videos"] = sample.pixels[start:start + video.n_tiles][None]
        loss = model(**kwargs).loss * n_targets
        loss.backward()
        total += float(loss.detach())
        count += n_targets
    grads = {name: p.grad / count for name, p in model.named_parameters() if p.grad is not None}
    return total / count, count, grads


def load_rank_gradients(out_dir: str | Path, world: int):
    """[(name, grad, shard or None)] of every rank's dump (shard = {"offset", "shape"} in the global tensor)."""
    out = []
    for rank in range(world):
        grads = load_file(Path(out_dir) / f"grads_rank{rank}.safetensors")
        shards = json.loads((Path(out_dir) / f"shards_rank{rank}.json").read_text())
        for key, grad in grads.items():
            out.append((rank, key.split("@")[0], grad, shards.get(key)))
    return out


def compare(out_dir: str | Path, world: int, ref_loss: float, ref_count: int, ref_grads: dict) -> list[str]:
    """Mismatch lines (empty when the distributed run equals the reference)."""
    result = json.loads((Path(out_dir) / "result.json").read_text())
    problems = []
    if result["n_answer"] != ref_count:
        problems.append(f"answer tokens {result['n_answer']} != reference {ref_count}")
    if abs(result["loss"] - ref_loss) > 1e-5 * max(1.0, abs(ref_loss)):
        problems.append(f"loss {result['loss']:.8f} != reference {ref_loss:.8f}")
    seen = set()
    for rank, name, grad, shard in load_rank_gradients(out_dir, world):
        ref = ref_grads.get(name)
        if ref is None:
            if grad.abs().max() > 0:
                problems.append(f"rank {rank} {name}: gradient where the reference has none")
            continue
        if shard is not None:
            ref = ref[tuple(slice(o, o + n) for o, n in zip(shard["offset"], shard["shape"]))]
        scale = max(1e-3, float(ref.abs().max()))
        if grad.shape != ref.shape or not torch.allclose(grad, ref, rtol=1e-4, atol=1e-5 * scale):
            diff = (grad - ref).abs().max().item() if grad.shape == ref.shape else "shape"
            problems.append(f"rank {rank} {name}: max |diff| {diff} (ref max {scale:.3g})")
        seen.add(name)
    missing = sorted(set(ref_grads) - seen)
    if missing:
        problems.append(f"reference gradients no rank holds: {missing[:5]}")
    return problems
