"""Model zoo: presets, builders (transformers models, random init or local weights), pipeline stages,
packed sequences and tensor-parallel shards.

Main entry points: `presets.vision_preset` / `presets.llm_preset`, `builder.build_model`,
`info.model_info`, `stages.build_vision_stage` / `stages.build_llm_stage`,
`tensor_parallel.shard_stage`.
"""
