"""Imported once by `run_ranks`' fork server (`gloo_ranks.PRELOAD`): builds the Qwen2.5 tokenizer,
which every trainer rank loads (`dflop.data.tokenizer.load_tokenizer`, cached per process) and
which costs each fresh process about 3 CPU-s converting the BPE ranks. The forked ranks inherit it
built. Building it starts no thread, encoding does (the Rust tokenizer's pool): keep this to
building, so that forking after it is as safe as after the imports."""

from dflop.data.tokenizer import load_tokenizer

load_tokenizer("qwen2.5")
