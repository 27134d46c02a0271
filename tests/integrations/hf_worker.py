"""Worker of test_hf_trainer_loss_and_gradients_are_the_whole_batch_mean: one optimizer step of HF's
Trainer with `DflopTrainer` on this gloo rank (2 ranks x 2 accumulation steps, 8 samples per step),
dumping the step's mean loss, the synchronised gradients before the optimizer, the global batch's
rows and every microbatch's sample count. `reference` is the single-process side.

Usage: torchrun --nproc-per-node 2 hf_worker.py DEMO_MANIFEST OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ARCH, VISION, LLM = "llava_ov", "siglip-tiny", "qwen2.5-tiny"
FRAMES = 32  # the model's video_frames: HF's LLaVA-OV batches videos of one frame count only
PER_MODALITY = 6  # the first samples of each modality: light and heavy ones, so microbatch sizes vary


def setup(manifest: str):
    """(config, TrainingData, shapes) of the test's pool: the demo's first samples of each modality."""
    from dflop.config import Config
    from dflop.data.readers import read_spec
    from dflop.data.training import TrainingData, pool_samples
    from dflop.integrations.hf import shapes_of_samples
    from dflop.models.handle import ModelHandle

    cfg = Config.from_dict({"run": {"seed": 1}, "model": {"arch": ARCH, "vision": VISION, "llm": LLM},
                            "data": {"datasets": [{"name": "demo", "path": str(manifest)}]},
                            "cluster": {"device": "cpu", "nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 1000}})
    shapes = shapes_of_samples(read_spec(cfg.datasets[0], cfg.seed), cfg)
    shapes = shapes[(shapes["status"] == "ok") & ((shapes["modality"] != "video") | (shapes["n_frames"] == FRAMES))]
    shapes = shapes.groupby("modality").head(PER_MODALITY).reset_index(drop=True)
    data = TrainingData(pool_samples(shapes, cfg.datasets, cfg.seed), ModelHandle.resolve(cfg.model).sample_rules())
    return cfg, data, shapes


def reference(manifest: str, out_dir, rows: list[int]):
    """(loss, {name: grad}) of the mean answer-token loss over pool `rows`, one process, transformers'
    own model on each sample (`tests/runtime/trainer_reference.py`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from trainer_reference import reference_gradients

    _, data, _ = setup(manifest)
    loss, _, grads = reference_gradients(ARCH, VISION, LLM, data, rows, seed=0)
    return loss, grads


def main(manifest: str, out_dir: str) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from dflop.integrations.hf import DflopTrainer, LlavaOnevisionCollator, Sampling, TokenItems
    from dflop.models.builder import build_model
    from dflop.runtime.process_group import end_worker

    cfg, data, shapes = setup(manifest)
    model = build_model(ARCH, VISION, LLM, seed=0, llm_attention="sdpa")
    grads: dict = {}
    sizes: list[int] = []
    losses: list[float] = []
    rows: list[list[int]] = []  # per collated batch (accelerate's loader collates one batch ahead)

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    class Recording(DflopTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            sizes.append(int(inputs["input_ids"].shape[0]))
            loss = super().training_step(model, inputs, num_items_in_batch)
            losses.append(float(loss))
            return loss

    collator = LlavaOnevisionCollator(data, pad_token_id=0)

    def collate(features):
        rows.append([int(f["dflop_index"]) for f in features])
        return collator(features)

    args = TrainingArguments(output_dir=str(Path(out_dir) / "hf"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=1, learning_rate=1e-3, max_grad_norm=0.0,
                             use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
                             remove_unused_columns=False, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = Recording(model=model, args=args, train_dataset=TokenItems(data), data_collator=collate,
                        callbacks=[Grab()], dflop=Sampling.from_config(cfg, shapes=shapes))
    trainer.train()
    # Each microbatch's returned loss is its answer-token loss sum / the step's global count x world
    # size (HF's scaling, undone by DDP's mean): summed over microbatches and ranks, / world = the mean.
    world = dist.get_world_size()
    total = torch.tensor([sum(losses)], dtype=torch.float64)
    dist.all_reduce(total)
    gathered: list = [None] * world
    trained = [r for batch in rows[:len(sizes)] for r in batch]
    dist.all_gather_object(gathered, {"rows": trained, "sizes": sizes})
    if dist.get_rank() == 0:
        torch.save(grads, Path(out_dir) / "grads.pt")
        (Path(out_dir) / "result.json").write_text(json.dumps({
            "loss": float(total) / world, "rows": sorted(r for g in gathered for r in g["rows"]),
            "sizes": [g["sizes"] for g in gathered]}))
    end_worker()


if __name__ == "__main__":
    main(*sys.argv[1:3])
