"""The one pricing path: what a global batch costs on a plan (`pricing.Pricing`).

A layer of its own between the cost model and the scheduler, so that the trainer, the online
scheduler, the planner and `dflop simulate` price alike without the runtime or the scheduler
importing the planner: runtime -> scheduler -> pricing -> costmodel (`tests/test_layering.py`).

- `cluster`: the machines (`Cluster`) and the links a layout's transfers use (`Links`, `links`);
- `pool`: the samples a batch is priced on (`Pool`) and the bytes they send (`TransferSizes`);
- `tail`: what a stage pays after its last backward (gradient sync, optimizer step, extras);
- `stage`: a stage's fixed terms (its training state, its whole tail), composed once for `Pricing`
  and the planner's stage model (which evaluates them at 0 and 1 layers per stage);
- `pricing`: `Pricing`, per-sample stage costs with transfers, and the per-stage tails.
"""
