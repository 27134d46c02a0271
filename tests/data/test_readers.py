"""Dataset readers and sampling rules: equal to whole-file parsing, bad input becomes reasons."""

import io
import json
import random
import re
import tracemalloc
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from bad_inputs import corrupt_image_page, write_image_parquet
from dflop.data.media import EmbeddedSource, image_size
from dflop.data.readers import (
    DatasetError,
    check_dataset,
    count_records,
    embedded_image_bytes,
    iter_json_array,
    iter_raw_samples,
    read_dataset,
)
from dflop.data.sampling import (
    SamplingRuleError,
    parse_sampling_rule,
    reservoir_indices,
    sample_stream,
)
from dflop.errors import UserError

CONV = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "This."}]


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --- JSON streaming ------------------------------------------------------------------------------


TRICKY = [
    {"id": "a", "conversations": [{"from": "human", "value": "brackets ] [ } { and \"quotes\""}]},
    {"id": 7, "nested": {"x": [1, 2.5e-3, -0.0, None, True, False, {"deep": [[], {}]}]}},
    {"id": "unicode", "value": "naïve café – 日本語 🙂 \\u escapes \n\t"},
    12345678901234567890,
    -1.5e300,
    "a plain string",
    [],
    {},
]


@pytest.mark.parametrize("chunk_chars", [1, 2, 3, 7, 64, 1 << 20])
def test_streaming_json_equals_json_load(tmp_path, chunk_chars):
    for indent in (None, 2):
        path = tmp_path / "tricky.json"
        path.write_text(json.dumps(TRICKY, indent=indent, ensure_ascii=False), encoding="utf-8")
        assert list(iter_json_array(path, chunk_chars=chunk_chars)) == json.loads(path.read_text())


def test_streaming_json_equals_json_load_on_demo(demo_manifest):
    expected = json.loads(demo_manifest.read_text())
    assert list(iter_json_array(demo_manifest, chunk_chars=4096)) == expected


@pytest.mark.parametrize("text", ["[]", "  [ ]  \n", "\ufeff[]"])
def test_empty_json_list(tmp_path, text):
    path = tmp_path / "empty.json"
    path.write_text(text, encoding="utf-8")
    assert list(iter_json_array(path)) == []


@pytest.mark.parametrize(
    "text, where",
    [
        ('[{"id": 1}, {"id": 2,,}]', 21),
        ('[{"id": 1} {"id": 2}]', 11),
        ('[{"id": 1}, {"id": 2}', 21),
        ('[{"id": 1}] trailing', 12),
        ('[{"id": "unterminated}]', None),
    ],
)
def test_corrupt_json_list_names_file_and_offset(tmp_path, text, where):
    path = tmp_path / "bad.json"
    path.write_text(text)
    for chunk_chars in (1, 3, 1 << 20):
        with pytest.raises(DatasetError, match="bad.json: malformed JSON at character") as info:
            list(iter_json_array(path, chunk_chars=chunk_chars))
        if where is not None:
            assert f"character {where}" in str(info.value)
        assert "\n" not in str(info.value)


def test_json_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('[{"id": "caf\u00e9"}]'.encode("latin-1"))
    with pytest.raises(DatasetError, match="latin1.json: not UTF-8"):
        list(iter_json_array(path))


def test_json_that_is_not_a_list(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"data": []}')
    with pytest.raises(DatasetError, match="obj.json: expected a JSON list"):
        list(iter_json_array(path))


def test_json_reader_memory_does_not_grow_with_file_size(tmp_path):
    record = {"id": "x", "image": "a.jpg", "conversations": CONV * 20}
    path = tmp_path / "big.json"
    path.write_text(json.dumps([record] * 4000))  # ~5 MB
    assert path.stat().st_size > 4e6
    tracemalloc.start()
    try:
        n = sum(1 for _ in iter_json_array(path, chunk_chars=1 << 16))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 4000
    assert peak < 1e6


# --- records to samples ---------------------------------------------------------------------------


def test_demo_dataset_reads_back(demo_manifest):
    expected = json.loads(demo_manifest.read_text())
    samples = list(read_dataset(demo_manifest, dataset="demo"))
    assert [s.sample_id for s in samples] == [r["id"] for r in expected]
    assert [s.index for s in samples] == list(range(len(expected)))
    root = demo_manifest.parent
    for sample, record in zip(samples, expected):
        assert sample.error is None and sample.dataset == "demo"
        image = record.get("image")
        paths = [image] if isinstance(image, str) else (image or [])
        assert [ref.path for ref in sample.images] == [root / p for p in paths]
        assert (sample.video.path if sample.video else None) == (
            root / record["video"] if "video" in record else None
        )
        assert list(sample.conversations) == record["conversations"]
        expected_modality = (
            "video" if "video" in record else
            "multi_image" if len(paths) > 1 else "image" if paths else "text"
        )
        assert sample.modality == expected_modality


def test_bad_records_become_reasons(tmp_path):
    good = {"id": "ok", "image": "x.jpg", "conversations": CONV}
    lines = [
        json.dumps(good),
        '{"id": "broken", "conversations": [',
        "",  # blank lines are not records
        json.dumps({"id": "noconv", "image": "x.jpg"}),
        json.dumps({"id": "emptyconv", "conversations": []}),
        json.dumps({"id": "aud", "audio": "a.wav", "conversations": CONV}),
        json.dumps([1, 2]),
        json.dumps({"id": "badturn", "conversations": [{"from": "human", "value": 3}]}),
        json.dumps({"id": "badimg", "image": 5, "conversations": CONV}),
        json.dumps({"id": "badimg2", "image": ["a.jpg", None], "conversations": CONV}),
        json.dumps({"id": "twovid", "video": ["a.mp4", "b.mp4"], "conversations": CONV}),
        json.dumps({"id": "badvid", "video": {"x": 1}, "conversations": CONV}),
        b"\xff\xfe not utf8".decode("latin-1"),
        json.dumps({"id": "nullaudio", "audio": None, "conversations": CONV}),
    ]
    path = _write_jsonl(tmp_path / "mixed.jsonl", lines)
    samples = list(iter_raw_samples(path))
    got = [(s.sample_id, s.error) for s in samples]
    assert got == [
        ("ok", None),
        ("mixed:1", "malformed_json"),
        ("noconv", "no_conversations"),
        ("emptyconv", "no_conversations"),
        ("aud", "unknown_modality:audio"),
        ("mixed:5", "not_an_object"),
        ("badturn", "bad_conversations"),
        ("badimg", "bad_image_field"),
        ("badimg2", "bad_image_field"),
        ("twovid", "multiple_videos"),
        ("badvid", "bad_video_field"),
        ("mixed:11", "malformed_json"),
        ("nullaudio", None),
    ]
    bad = samples[2]
    assert bad.images == () and bad.video is None and bad.conversations is None


def test_ids_are_stable_and_unique(tmp_path):
    lines = [json.dumps({**r, "conversations": CONV}) for r in (
        {"id": "a"}, {"id": "a"}, {}, {"id": 42}, {"id": ""}, {"id": True}, {"id": "ds:6"}, {},
    )]
    path = _write_jsonl(tmp_path / "ids.jsonl", lines)
    samples = list(iter_raw_samples(path, dataset="ds"))
    ids = [s.sample_id for s in samples]
    # the record at index 7 would fall back to "ds:7"; index 6 took "ds:6" as its own id
    assert ids == ["a", "ds:1", "ds:2", "42", "ds:4", "ds:5", "ds:6", "ds:7"]
    assert ids == [s.sample_id for s in iter_raw_samples(path, dataset="ds")]
    # Only the repeated id is a rename to report; records without an id just take their position.
    assert [s.id_note for s in samples] == [None, "id 'a' repeats record 0's", *[None] * 6]
    clash = _write_jsonl(tmp_path / "clash.jsonl", [
        json.dumps({"id": "ds:1", "conversations": CONV}), json.dumps({"conversations": CONV}),
        json.dumps({"id": "ds:1", "conversations": CONV}),
    ])
    ids = [s.sample_id for s in iter_raw_samples(clash, dataset="ds")]
    assert len(set(ids)) == 3 and ids[:2] == ["ds:1", "ds:1:1"]


def _media_tree(tmp_path):
    """media/ (the root) with a.png, a symlink to a file outside, a symlinked directory leading
    outside, a symlink staying inside; outside/ next to it with secret.png."""
    media, outside = tmp_path / "media", tmp_path / "outside"
    (media / "rel").mkdir(parents=True)
    outside.mkdir()
    for path in (media / "rel" / "a.png", outside / "secret.png"):
        Image.new("RGB", (4, 4)).save(path)
    (media / "leak.png").symlink_to(outside / "secret.png")
    (media / "leakdir").symlink_to(outside, target_is_directory=True)
    (media / "alias.png").symlink_to(media / "rel" / "a.png")
    return media, outside


def test_media_paths_must_resolve_inside_media_root(tmp_path):
    media, outside = _media_tree(tmp_path)
    paths = {
        "rel": "rel/a.png",
        "alias": "alias.png",  # a symlink that stays inside
        "abs-inside": str(media / "rel" / "a.png"),
        "missing": "rel/gone.png",  # inside, so left to the media check (missing_file)
        "dotdot": "../outside/secret.png",
        "dotdot-deep": "rel/../../outside/secret.png",
        "link": "leak.png",
        "linkdir": "leakdir/secret.png",
        "abs-outside": str(outside / "secret.png"),
    }
    lines = [json.dumps({"id": k, "image": v, "conversations": CONV}) for k, v in paths.items()]
    lines.append(json.dumps({"id": "video", "video": "../outside/v.mp4", "conversations": CONV}))
    manifest = _write_jsonl(tmp_path / "m.jsonl", lines)
    samples = {s.sample_id: s for s in iter_raw_samples(manifest, media_root=media)}
    for key in ("rel", "alias", "abs-inside", "missing"):
        assert samples[key].error is None, key
    assert samples["rel"].images[0].path == media / "rel" / "a.png"  # as written, joined to the root
    escaped = ("dotdot", "dotdot-deep", "link", "linkdir", "abs-outside", "video")
    assert {k: samples[k].error for k in escaped} == dict.fromkeys(escaped, "media_outside_root")
    assert not samples["link"].images and samples["link"].conversations is None
    assert samples["link"].error_detail == (f"leak.png leads to {outside.resolve() / 'secret.png'}, outside "
                                            f"media_root {media}")
    assert "allow_absolute_paths: true" in samples["abs-outside"].error_detail

    allowed = {s.sample_id: s for s in iter_raw_samples(manifest, media_root=media, allow_absolute_paths=True)}
    assert allowed["abs-outside"].error is None
    assert allowed["abs-outside"].images[0].path == outside / "secret.png"
    # Relative paths stay inside media_root whatever the dataset allows.
    assert {k: allowed[k].error for k in escaped if k != "abs-outside"} == dict.fromkeys(
        set(escaped) - {"abs-outside"}, "media_outside_root")


def test_a_symlinked_media_root_holds_its_files(tmp_path):
    media, _ = _media_tree(tmp_path)
    (tmp_path / "root-link").symlink_to(media, target_is_directory=True)
    manifest = _write_jsonl(tmp_path / "m.jsonl", [json.dumps({"id": "r", "image": "rel/a.png", "conversations": CONV})])
    (sample,) = iter_raw_samples(manifest, media_root=tmp_path / "root-link")
    assert sample.error is None and sample.images[0].path == tmp_path / "root-link" / "rel" / "a.png"


def test_media_paths_resolve_against_media_root(tmp_path):
    lines = [json.dumps({"id": "r", "image": ["rel/a.png", str(tmp_path / "abs" / "b.png")], "video": "v.mp4",
                         "conversations": CONV})]
    path = _write_jsonl(tmp_path / "paths.jsonl", lines)
    (sample,) = iter_raw_samples(path)
    assert [r.path for r in sample.images] == [tmp_path / "rel/a.png", tmp_path / "abs" / "b.png"]
    assert sample.video.path == tmp_path / "v.mp4"
    (sample,) = iter_raw_samples(path, media_root=tmp_path / "media", allow_absolute_paths=True)
    assert sample.images[0].path == tmp_path / "media" / "rel/a.png"


def test_format_detection_and_override(tmp_path):
    records = [{"id": "a", "conversations": CONV}, {"id": "b", "conversations": CONV}]
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(records))
    lines_in_json = _write_jsonl(tmp_path / "lines.json", [json.dumps(r) for r in records])
    odd_ext = _write_jsonl(tmp_path / "data.txt", [json.dumps(r) for r in records])
    assert check_dataset(as_list) == "llava_json"
    assert check_dataset(lines_in_json) == "llava_jsonl"
    for path, fmt in ((as_list, "auto"), (lines_in_json, "auto"), (odd_ext, "llava_jsonl")):
        assert [s.sample_id for s in read_dataset(path, fmt=fmt)] == ["a", "b"]
    with pytest.raises(DatasetError, match=r"data.txt: cannot tell the format"):
        read_dataset(odd_ext)
    with pytest.raises(DatasetError, match=r"unknown format 'csv'"):
        read_dataset(as_list, fmt="csv")


def test_missing_dataset_raises_at_call_time(tmp_path):
    with pytest.raises(DatasetError, match=r"nothere.json: no such file"):
        read_dataset(tmp_path / "nothere.json")  # no iteration needed
    with pytest.raises(DatasetError, match=r"holds no .parquet files"):
        check_dataset(tmp_path)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match=r"junk.parquet: unreadable Parquet"):
        check_dataset(tmp_path)


# --- Parquet ---------------------------------------------------------------------------------------


def _png(width, height, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
TURN = pa.struct([("from", pa.string()), ("value", pa.string())])


def test_parquet_with_embedded_images_round_trip(tmp_path):
    images = [_png(20 + i, 10 + i, i) for i in range(6)]
    single = pa.table({
        "id": ["p0", "p1", "p2", "p3"],
        "image": pa.array([
            {"bytes": images[0], "path": "coco/0.png"},
            None,
            {"bytes": None, "path": "on_disk.png"},
            {"bytes": images[1], "path": None},
        ], type=IMAGE_STRUCT),
        "conversations": pa.array([CONV, CONV[1:], CONV, None], type=pa.list_(TURN)),
        "data_source": ["a", "b", "c", "d"],
    })
    multi = pa.table({
        "id": ["q0", "p0"],
        "image": pa.array([
            [{"bytes": images[2], "path": "x.png"}, {"bytes": images[3], "path": "y.png"}],
            [{"bytes": images[4], "path": None}],
        ], type=pa.list_(IMAGE_STRUCT)),
        "conversations": pa.array([CONV, CONV], type=pa.list_(TURN)),
        "audio": pa.array([None, "sound.wav"]),
    })
    folder = tmp_path / "ov_data"
    folder.mkdir()
    pq.write_table(single, folder / "part-0.parquet", row_group_size=3)
    pq.write_table(multi, folder / "part-1.parquet", row_group_size=1)

    assert check_dataset(folder) == "parquet"
    assert count_records(folder) == 6
    samples = list(read_dataset(folder))
    assert [s.sample_id for s in samples] == ["p0", "p1", "p2", "p3", "q0", "ov_data:5"]
    assert [s.error for s in samples] == [
        None, None, None, "no_conversations", None, "unknown_modality:audio"
    ]
    assert samples[0].dataset == "ov_data" and samples[0].images[0].data == images[0]
    assert samples[0].images[0].name == "coco/0.png"
    assert image_size(samples[0].images[0]) == (20, 10)
    assert samples[1].images == () and samples[1].modality == "text"
    assert samples[2].images[0].path == folder / "on_disk.png"
    assert [r.data for r in samples[4].images] == images[2:4]
    assert [image_size(r) for r in samples[4].images] == [(22, 12), (23, 13)]
    assert samples[4].modality == "multi_image"
    assert list(samples[4].conversations) == CONV

    one_file = list(read_dataset(folder / "part-1.parquet", dataset="ov"))
    assert [s.sample_id for s in one_file] == ["q0", "p0"]

    # Without their bytes, embedded images are found again from (file, row, column, list item),
    # across row groups (part-0 has groups of 3 rows, part-1 of 1 row).
    lean = [ref.without_bytes() for ref in (samples[0].images[0], *samples[4].images)]
    assert all(ref.data is None for ref in lean) and "part-0.parquet row 0" in lean[0].label
    assert [embedded_image_bytes(ref.source) for ref in lean] == [images[0], images[2], images[3]]
    # row 3: the second row group of part-0
    assert embedded_image_bytes(replace(lean[0].source, row=3)) == images[1]
    assert samples[2].images[0].without_bytes() is samples[2].images[0]  # a file on disk stays as it is
    with pytest.raises(DatasetError, match=r"part-0\.parquet row 7: the file has only 4 rows"):
        embedded_image_bytes(replace(lean[0].source, row=7))


@pytest.mark.parametrize("where, page_checksums", [("header", False), ("payload", True)])
def test_corrupt_parquet_page_is_a_one_line_error_naming_the_file(tmp_path, where, page_checksums):
    folder = tmp_path / "ov"
    folder.mkdir()
    part = write_image_parquet(folder / "part-0.parquet", n_rows=40, row_group_size=10,
                               write_page_checksum=page_checksums)
    corrupt_image_page(part, row_group=2, where=where)  # rows 20-29
    # Footer and schema are intact: the damage shows only when the page is read.
    assert check_dataset(folder) == "parquet" and count_records(folder) == 40
    with pytest.raises(DatasetError) as info:
        list(read_dataset(folder))
    message = str(info.value)
    assert isinstance(info.value, UserError)  # so the CLI prints it as one line, exit code 2
    assert "\n" not in message and message.isprintable()
    assert re.fullmatch(rf"dataset {re.escape(str(part))}: unreadable Parquet data after \d+ readable rows \(.+\)",
                        message), message
    if where == "payload":  # the page itself parses: only its CRC tells the bytes are wrong
        assert "CRC" in message
    # The trainer reading one image of that row group back from the file gets the same kind of error.
    with pytest.raises(DatasetError, match=rf"{re.escape(str(part))} row 25: cannot read column 'image'") as info:
        embedded_image_bytes(EmbeddedSource(part, 25, "image"))
    assert "\n" not in str(info.value)


def test_parquet_random_sampling_matches_streaming_choice(tmp_path):
    n = 50
    table = pa.table({"id": [f"s{i}" for i in range(n)],
                      "conversations": pa.array([CONV] * n, type=pa.list_(TURN))})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=7)
    picked = [s.sample_id for s in read_dataset(path, sample="random:9", seed=3)]
    # the same rule over the same ids in a JSONL file, where the count is not known up front
    jsonl = _write_jsonl(tmp_path / "t.jsonl", [json.dumps({"id": f"s{i}", "conversations": CONV})
                                                for i in range(n)])
    assert count_records(jsonl) is None
    assert [s.sample_id for s in read_dataset(jsonl, dataset="t", sample="random:9", seed=3)] == picked
    assert len(picked) == 9


# --- sampling rules -------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["", "some", "first:", "first:-1", "random:x", "0%", "101%",
                                  "10", "1e2%", "first:3:4", None])
def test_invalid_rules_name_the_rule(rule):
    with pytest.raises(SamplingRuleError, match=re.escape(repr(rule))):
        parse_sampling_rule(rule)


def test_valid_rules():
    assert str(parse_sampling_rule("all")) == "all"
    assert parse_sampling_rule("first:10").count == 10
    assert parse_sampling_rule("random:0").count == 0
    assert parse_sampling_rule("12.5%").percent == 12.5
    assert str(parse_sampling_rule("100%")) == "100%"


def _ids(n):
    return [f"id{i}" for i in range(n)]


def _pick(items, rule, seed=0, total=None):
    return list(sample_stream(items, rule, seed=seed, stream_name="ds", key=str, total=total))


def test_first_and_all():
    items = _ids(100)
    assert _pick(items, "all") == items
    assert _pick(items, "first:10") == items[:10]
    assert _pick(items, "first:1000") == items


def test_first_stops_reading():
    consumed = []

    def stream():
        for i in range(10**9):
            consumed.append(i)
            yield str(i)

    assert _pick(stream(), "first:5") == ["0", "1", "2", "3", "4"]
    assert len(consumed) <= 6


def test_random_is_deterministic_sized_ordered_and_uniform():
    items = _ids(200)
    picked = _pick(items, "random:20", seed=5)
    assert len(picked) == 20 == len(set(picked))
    assert picked == sorted(picked, key=items.index)  # file order
    assert picked == _pick(items, "random:20", seed=5)
    assert picked != _pick(items, "random:20", seed=6)
    assert _pick(items, "random:500") == items
    assert _pick(items, "random:0") == []
    # Each item is chosen with probability 20/200 (brute-force check over many seeds).
    counts = Counter(i for seed in range(1000) for i in _pick(range(200), "random:20", seed=seed))
    expected = 1000 * 20 / 200
    assert all(abs(counts[i] - expected) < 5 * np.sqrt(expected) for i in range(200))
    # With the count known up front the choice is the same, holding only the chosen items.
    for seed in range(20):
        for total, n in ((200, 20), (30, 29), (5, 9), (1, 1)):
            streamed = _pick(range(total), f"random:{n}", seed=seed)
            assert _pick(range(total), f"random:{n}", seed=seed, total=total) == streamed
            assert reservoir_indices(total, n, seed=seed, stream_name="ds") == streamed


def test_random_stops_early_when_count_known():
    consumed = []

    def stream():
        for i in range(1000):
            consumed.append(i)
            yield i

    picked = _pick(stream(), "random:3", seed=1, total=1000)
    assert len(picked) == 3 and len(consumed) == picked[-1] + 1


def test_percent_is_deterministic_nested_and_order_free():
    items = _ids(20000)
    ten = _pick(items, "10%", seed=1)
    n, p = len(items), 0.10
    assert abs(len(ten) - n * p) < 5 * np.sqrt(n * p * (1 - p))
    assert ten == _pick(items, "10%", seed=1)
    assert ten != _pick(items, "10%", seed=2)
    assert set(ten) <= set(_pick(items, "20%", seed=1))
    shuffled = items[:]
    random.Random(0).shuffle(shuffled)
    assert set(_pick(shuffled, "10%", seed=1)) == set(ten)
    assert _pick(items, "100%") == items


def test_read_dataset_applies_rules(demo_manifest):
    ids = [s.sample_id for s in read_dataset(demo_manifest)]
    assert [s.sample_id for s in read_dataset(demo_manifest, sample="first:7")] == ids[:7]
    picked = [s.sample_id for s in read_dataset(demo_manifest, sample="random:25", seed=4)]
    assert len(picked) == 25 and set(picked) <= set(ids)
    assert picked == [s.sample_id for s in read_dataset(demo_manifest, sample="random:25", seed=4)]
    with pytest.raises(SamplingRuleError, match="'most'"):
        read_dataset(demo_manifest, sample="most")
