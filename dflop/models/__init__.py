"""Model zoo: presets, builders (transformers models, random init or local weights), pipeline stages,
packed sequences and tensor-parallel shards.

Main entry points: `presets.vision_preset` / `presets.llm_preset`, `builder.build_model`,
`builder.build_on_meta` + `materialize.Materializer` (a rank's part only), `info.model_info`, `stages.build_vision_stage` / `stages.build_llm_stage`,
`tensor_parallel.shard_stage`.
"""
