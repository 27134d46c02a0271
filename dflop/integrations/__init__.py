"""DFLOP's scheduler inside other trainers (the top layer: it may import from every layer below).

`dflop.integrations.hf`: a batch sampler and a `transformers.Trainer` subclass that partition each
global batch across data-parallel ranks x gradient-accumulation microbatches with DFLOP's scheduler.
"""
