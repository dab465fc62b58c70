"""Hostile jsonl lines (issue 34): each one stops the load with one `FILE:LINE: reason`, or is skipped with
skip_bad_lines, for all three loaders; and what the line check accepts is exactly what the dataset holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dataset.jsonl
from dataset.dpo_dataset import DPODataset
from dataset.pretrain_dataset import PretrainDataset
from dataset.sft_dataset import SFTDataset
from tests.training_runs import write_jsonl

CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
GOOD = {
    "text": {"text": "good one " * 4},
    "conversations": {"conversations": CHAT},
    "preference": {"chosen": CHAT, "rejected": [CHAT[0], {"role": "assistant", "content": "Go away."}]},
}
LOADERS = {"text": PretrainDataset, "conversations": SFTDataset, "preference": DPODataset}
DEEP = "[" * 1000 + "]" * 1000
MAX_SEQ_LEN = {"text": 8, "conversations": 64, "preference": 64}


def _with_extra(kind: str, extra: str) -> str:
    """The good record of `kind` as a raw line with one more (ignored) field whose raw JSON is `extra`."""
    return json.dumps(GOOD[kind])[:-1] + f', "extra": {extra}}}'


# Raw lines, written verbatim as line 2 of a file between two good lines: (name, kind -> line, reason fragment).
HOSTILE = {
    "deep nesting in an ignored field": (lambda kind: _with_extra(kind, DEEP), "nested too deeply"),
    "deep nesting alone": (lambda kind: DEEP, "nested too deeply"),
    "lone surrogate": (lambda kind: {
        "text": r'{"text": "a\ud800b"}',
        "conversations": r'{"conversations": [{"role": "user", "content": "a\ud800b"}, '
                         r'{"role": "assistant", "content": "ok"}]}',
        "preference": json.dumps(GOOD["preference"]).replace("Go away.", r"Go \udfff away."),
    }[kind], "lone surrogate"),
    "lone surrogate with an extra key": (
        lambda kind: _with_extra(kind, "1").replace("Hello there.", r"Hello \ud800").replace("good one", r"\ud800"),
        "lone surrogate"),
    "form feed line": (lambda kind: "\f", "invalid JSON"),
    "vertical tab line": (lambda kind: "\v", "invalid JSON"),
    "duplicate key": (lambda kind: {
        "text": '{"text": 5, "text": "ok"}',
        "conversations": '{"conversations": [{"role": "user", "content": 1, "content": "a"}, '
                         '{"role": "assistant", "content": "ok"}]}',
        "preference": json.dumps(GOOD["preference"])[:-1] + ', "chosen": []}',
    }[kind], "duplicate key"),
    "duplicate key in an ignored field": (lambda kind: _with_extra(kind, '{"a": 1, "a": 2}'), 'duplicate key "a"'),
    # Not JSON, though Python's json reads them.
    "NaN in an ignored field": (lambda kind: _with_extra(kind, "NaN"), "NaN is not a JSON number"),
    "a number beyond float64": (lambda kind: _with_extra(kind, "-1e999"), "beyond the range of a 64-bit float"),
}


@pytest.fixture()
def cache(tmp_path: Path) -> Path:
    return tmp_path / "hf_cache"


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_line_is_one_file_line_error_or_skipped(tmp_path, cache, tokenizer, kind, name):
    make_line, reason = HOSTILE[name]
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD[kind], make_line(kind), GOOD[kind]])
    with pytest.raises(ValueError) as info:
        LOADERS[kind](path, tokenizer, MAX_SEQ_LEN[kind], cache_dir=cache)
    message = str(info.value)
    assert message.startswith(f"{path}:2: ") and reason in message and "\n" not in message, message
    loaded = LOADERS[kind](path, tokenizer, MAX_SEQ_LEN[kind], skip_bad_lines=True,
                            cache_dir=cache)
    assert loaded.stats["skipped_lines"] == 1 and loaded.stats["documents" if kind == "text" else "samples"] == 2


def test_blank_lines_are_json_whitespace_only(tmp_path, cache, tokenizer):
    """Spaces, tabs and a carriage return make a blank line (skipped, no error); a form feed does not (JSON does
    not count it as whitespace, so neither does the loader)."""
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD["text"], " \t\r", "", GOOD["text"]])
    assert PretrainDataset(path, tokenizer, 8, cache_dir=cache).stats["skipped_lines"] == 0


def test_duplicate_key_never_corrupts_the_other_texts(tmp_path, cache, tokenizer):
    """pyarrow, reading a file the line check had passed, once stored every text with its quotes."""
    texts = ["good", "better text"]
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": texts[0]}, '{"text": 5, "text": "ok"}', {"text": texts[1]}])
    ds = PretrainDataset(path, tokenizer, 2, skip_bad_lines=True, cache_dir=cache)
    stream = [token for i in range(len(ds)) for token in ds[i]["input_ids"].tolist()]
    expected = [token for text in texts
                for token in tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    assert stream == expected[: len(stream)] and len(expected) - len(stream) < 2


def test_second_load_reads_the_cache(tmp_path, cache, tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "some words " * 20, "extra": [1, {"a": None}]}] * 3)
    first = PretrainDataset(path, tokenizer, 8, cache_dir=cache)

    def no_parsing(*args, **kwargs):
        raise AssertionError("the file was read again")

    monkeypatch.setattr(dataset.jsonl, "parse_line", no_parsing)
    monkeypatch.setattr(dataset.jsonl, "iter_records", no_parsing, raising=False)
    second = PretrainDataset(path, tokenizer, 8, cache_dir=cache)
    assert second._tokens.cache_files == first._tokens.cache_files
    assert [second[i]["input_ids"].tolist() for i in range(len(second))] == \
        [first[i]["input_ids"].tolist() for i in range(len(first))]


def test_a_file_rewritten_in_place_with_the_same_size_is_read_again(tmp_path, cache):
    """The scan cache is keyed by the file's path, size and modification time: an edit that keeps the size (a word
    changed for another of its length) must not be served the old records."""
    import os

    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "cats"}])
    assert dataset.jsonl.load_jsonl(path, "text", cache_dir=cache)[0]["text"] == ["cats"]
    stat = path.stat()
    write_jsonl(path, [{"text": "dogs"}])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a later edit, whatever the clock
    assert path.stat().st_size == stat.st_size
    assert dataset.jsonl.load_jsonl(path, "text", cache_dir=cache)[0]["text"] == ["dogs"]


def _nested(depth: int) -> str:
    """A JSON object `depth` levels deep: {"a": [[...]]}."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def _calling(tool_calls: str | list) -> dict:
    return {"conversations": [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": None, "tool_calls": tool_calls}]}


# MiniMind's JSON-string fields hold JSON of their own, read by the same strict reader as the line: (line, reason).
HOSTILE_STRINGS = {
    "tool_calls nested 5000 deep": (_calling("[" * 5000 + "]" * 5000),
                                    "conversations[1].tool_calls is nested too deeply (more than 100 levels"),
    "tools nested 5000 deep": ({"conversations": [{"role": "system", "content": "s", "tools": "[" * 5000},
                                                  {"role": "user", "content": "q"}]},
                               "conversations[0].tools is nested too deeply"),
    "arguments nested 5000 deep": (_calling('[{"name": "f", "arguments": "' + "[" * 5000 + '"}]'),
                                   "conversations[1].tool_calls[0].arguments is nested too deeply"),
    "a lone surrogate in the arguments": (_calling('[{"name": "f", "arguments": {"x": "\\ud800"}}]'),
                                          'conversations[1].tool_calls[0]["arguments"]["x"] holds a lone surrogate'),
    "a key twice in the calls": (_calling('[{"name": "f", "name": "g", "arguments": {}}]'),
                                 'conversations[1].tool_calls has a duplicate key "name"'),
    # Within the bound as given, beyond it as kept (arguments parsed into the call, one call put in a list, a bare
    # function wrapped): the tokenizing map read the kept value again and stopped the run naming no file or line,
    # and --skip_bad_lines did not skip it.
    "arguments at the bound, as a JSON string": (
        _calling([{"type": "function", "function": {"name": "f", "arguments": _nested(100)}}]),
        "conversations[1].tool_calls is nested too deeply (more than 100 levels"),
    "one call, not in a list, at the bound": (
        _calling('{"name": "f", "arguments": ' + _nested(99) + "}"),
        "conversations[1].tool_calls is nested too deeply (more than 100 levels"),
    "a bare tool function at the bound": (
        {"conversations": [{"role": "system", "content": "s",
                            "tools": '[{"name": "f", "parameters": {"properties": {"x": ' + _nested(96) + "}}}]"},
                           {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        "conversations[0].tools is nested too deeply (more than 100 levels"),
    # The chat template adds a description to a text (a number or an object fails there, while the trainer's own
    # rendering wrote its Python repr into the system turn).
    "a tool description that is not a string": (
        {"conversations": [{"role": "system", "content": "s", "tools": [{"type": "function", "function": {
            "name": "f", "description": {"text": "d"}}}]}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}]},
        "conversations[0].tools[0].function.description must be a string, got dict"),
}


@pytest.mark.parametrize("name", HOSTILE_STRINGS)
def test_hostile_json_strings_are_one_line_errors_or_skipped(tmp_path, cache, tokenizer, name):
    line, reason = HOSTILE_STRINGS[name]
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD["conversations"], line, GOOD["conversations"]])
    with pytest.raises(ValueError) as info:
        SFTDataset(path, tokenizer, MAX_SEQ_LEN["conversations"], cache_dir=cache)
    message = str(info.value)
    assert message.startswith(f"{path}:2: ") and reason in message and "\n" not in message, message
    loaded = SFTDataset(path, tokenizer, MAX_SEQ_LEN["conversations"], skip_bad_lines=True, cache_dir=cache)
    assert loaded.stats["skipped_lines"] == 1 and loaded.stats["samples"] == 2


# ----------------------------------------------------------------------------- a damaged scan cache
def _scan_files(path: Path, cache: Path) -> tuple[Path, Path]:
    """The report JSON and the Arrow file of `path`'s scan."""
    scan = dataset.jsonl.scan_jsonl(path, "text", cache_dir=cache)
    return Path(scan.arrow_path).with_suffix(".json"), Path(scan.arrow_path)


def _arrow_without_its_last_batches(arrow: Path) -> None:
    import pyarrow as pa
    with pa.ipc.open_stream(arrow.read_bytes()) as reader:
        first = reader.read_next_batch()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, first.schema) as writer:
        writer.write_batch(first)
    arrow.write_bytes(sink.getvalue().to_pybytes())


ARROW_ROWS = 2 * dataset.jsonl.BATCH_RECORDS + 5  # the damaged cache's file: three batches


@pytest.mark.parametrize("damage", [
    # another file's records
    lambda report, arrow, other: report.write_text(json.dumps({"arrow_path": str(other), "records": 2,
                                                               "skipped_lines": 0, "empty_documents": 0})),
    lambda report, arrow, other: report.write_text(json.dumps({"arrow_path": str(report), "records": 1,
                                                               "skipped_lines": 0, "empty_documents": 0})),  # no Arrow
    lambda report, arrow, other: report.write_text(json.dumps({"arrow_path": str(arrow), "records": "many",
                                                               "skipped_lines": None, "empty_documents": 0})),
    lambda report, arrow, other: report.write_text(json.dumps({"arrow_path": str(arrow), "records": ARROW_ROWS * 1.0,
                                                               "skipped_lines": 0, "empty_documents": 0})),  # float ==
    lambda report, arrow, other: report.write_text(json.dumps({"arrow_path": str(arrow), "records": ARROW_ROWS,
                                                               "skipped_lines": -1, "empty_documents": 0})),
    lambda report, arrow, other: report.write_text(json.dumps({"arrow_path": str(arrow), "records": ARROW_ROWS,
                                                               "skipped_lines": 0, "empty_documents": -1})),
    lambda report, arrow, other: report.write_text(json.dumps({"arrow_path": str(arrow), "records": ARROW_ROWS,
                                                               "skipped_lines": 0})),  # before empty_documents
    lambda report, arrow, other: report.write_text("[]"),
    lambda report, arrow, other: arrow.write_bytes(arrow.read_bytes()[:len(arrow.read_bytes()) // 2]),
    lambda report, arrow, other: _arrow_without_its_last_batches(arrow),  # whole batches lost: fewer rows
], ids=["foreign arrow", "not arrow", "wrong types", "float records", "negative skips", "negative empties",
        "no empties count", "not a report", "truncated arrow", "lost batches"])
def test_a_damaged_scan_cache_is_rebuilt_not_read(tmp_path, cache, damage):
    texts = [f"line {i}" for i in range(ARROW_ROWS)]
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    other = write_jsonl(tmp_path / "b.jsonl", [{"text": "other"}, {"text": "file"}])
    _, other_arrow = _scan_files(other, cache)
    report, arrow = _scan_files(path, cache)
    damage(report, arrow, other_arrow)
    loaded, scan = dataset.jsonl.load_jsonl(path, "text", cache_dir=cache)
    assert loaded["text"] == texts and scan.records == len(texts) and scan.arrow_path == str(arrow.resolve())
    assert type(scan.records) is int and scan.skipped_lines == 0  # the rebuilt report's counts, not the damaged one's


@pytest.mark.parametrize("under", [False, True])
def test_a_scan_cache_folder_that_is_a_file_is_one_line(tmp_path, under):
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD["text"]])
    blocker = tmp_path / "hf_cache"
    blocker.write_text("x")
    cache_dir = blocker / "sub" if under else blocker
    with pytest.raises(ValueError) as refused:
        dataset.jsonl.scan_jsonl(path, "text", cache_dir=cache_dir)
    assert str(refused.value) == f"{cache_dir / 'mininorm_jsonl'}: {blocker} is a file, not a folder"


def test_a_data_path_that_is_missing_or_a_folder_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^no such data file: {tmp_path / 'none.jsonl'}$"):
        dataset.jsonl.scan_jsonl(tmp_path / "none.jsonl", "text", cache_dir=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path} is a folder, not a jsonl data file$"):
        dataset.jsonl.scan_jsonl(tmp_path, "text", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_data_path_that_is_no_regular_file_says_what_it_is(tmp_path, kind):
    """A FIFO (a shell's <(zcat data.jsonl.gz)) or a device exists: "no such data file" sent the user looking for a
    file that is there. The scan is cached by the file's size and time, so a regular file it must be."""
    import os

    if kind == "fifo":
        path = tmp_path / "pipe.jsonl"
        os.mkfifo(path)
        what = "a FIFO (a pipe)"
    else:
        path, what = Path("/dev/null"), "a device"
    with pytest.raises(FileNotFoundError) as refused:
        dataset.jsonl.scan_jsonl(path, "text", cache_dir=tmp_path / "cache")
    assert str(refused.value) == (f"{path} is {what}, not a regular file: a jsonl data file must be a regular file "
                                  f"(write the data to one first)")


def _container_files(folder: Path) -> dict[str, Path]:
    """One small file of each format FILE_FORMATS names, each holding the jsonl line {"text": "hello"}, written by
    the format's own library."""
    import bz2
    import gzip
    import lzma
    import zipfile

    import pyarrow as pa
    import pyarrow.feather
    import pyarrow.parquet

    line = b'{"text": "hello"}\n'
    table = pa.table({"text": ["hello"]})
    files = {"gzip-compressed": folder / "data.jsonl.gz", "bzip2-compressed": folder / "data.jsonl.bz2",
             "xz-compressed": folder / "data.jsonl.xz", "zstd-compressed": folder / "data.jsonl.zst",
             "a zip archive": folder / "data.zip", "a Parquet file": folder / "data.parquet",
             "an Arrow file": folder / "data.feather", "an Arrow stream (a datasets cache file)": folder / "data.arrow"}
    files["gzip-compressed"].write_bytes(gzip.compress(line))
    files["bzip2-compressed"].write_bytes(bz2.compress(line))
    files["xz-compressed"].write_bytes(lzma.compress(line))
    files["zstd-compressed"].write_bytes(pa.compress(line, codec="zstd", asbytes=True))
    with zipfile.ZipFile(files["a zip archive"], "w") as archive:
        archive.writestr("data.jsonl", line)
    pyarrow.parquet.write_table(table, files["a Parquet file"])
    pyarrow.feather.write_feather(table, str(files["an Arrow file"]))
    with pa.OSFile(str(files["an Arrow stream (a datasets cache file)"]), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    return files


def test_a_compressed_or_columnar_data_file_is_named_as_what_it_is(tmp_path):
    """A download left compressed, a Hub dataset's Parquet or Arrow file given as --data_path was
    'data.jsonl.gz:1: not valid UTF-8 (byte 0x8b at offset 1)', which does not say why; now the file is named as
    what it is, with how to make jsonl of it, before the work (check_data_file: the trainers, evaluate, the
    tokenizer's training)."""
    files = _container_files(tmp_path)
    assert {what for what, _ in dataset.jsonl.FILE_FORMATS.values()} == set(files)  # every format is tried here
    for what, path in files.items():
        with pytest.raises(ValueError) as refused:
            dataset.jsonl.scan_jsonl(path, "text", cache_dir=tmp_path / "cache")
        message = str(refused.value)
        assert message.startswith(f"{path}: is {what}, not jsonl text (one JSON object per line); "), message
        assert str(path) in message.split("; ", 1)[1] and "\n" not in message, message


@pytest.mark.parametrize("kind, record, words", [
    ("conversations", {"text": "Hello."}, 'missing "conversations" field; the line holds "text": it is pretraining '
                                          'text, data of another kind'),
    ("text", {"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     'missing "text" field; the line holds "conversations": it is an SFT conversation, data of another kind'),
    ("preference", {"conversations": [{"role": "user", "content": "Hi"}]},
     'missing "chosen" field; the line holds "conversations": it is an SFT conversation, data of another kind'),
    ("conversations", {"chosen": [], "rejected": []},
     'missing "conversations" field; the line holds "chosen": it is a DPO pair, data of another kind'),
    # a field of the same kind, or none of any kind: the plain words
    ("preference", {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     'missing "rejected" field'),
    ("text", {"txt": "typo"}, 'missing "text" field')])
def test_a_file_of_another_kind_of_data_is_named_as_such(tmp_path, kind, record, words):
    """Pretraining text given to SFT (or to a distillation reading conversations) was 'missing "conversations"
    field', which does not say that the whole file is data of another kind."""
    path = write_jsonl(tmp_path / "data.jsonl", [record])
    with pytest.raises(ValueError) as refused:
        dataset.jsonl.scan_jsonl(path, kind, cache_dir=tmp_path / "cache")
    assert str(refused.value) == f"{path}:1: {words}"


def test_a_line_that_is_not_utf8_names_the_byte_and_its_offset():
    with pytest.raises(dataset.jsonl.BadLine) as refused:
        dataset.jsonl.parse_line(b'{"text": "caf\xe9"}')
    assert str(refused.value) == "not valid UTF-8 (byte 0xe9 at offset 13)"


BOM = b"\xef\xbb\xbf"  # U+FEFF in UTF-8, which many Windows editors write at the start of a file


@pytest.mark.parametrize("kind", LOADERS)
def test_a_byte_order_mark_at_the_start_of_the_file_is_not_content(tmp_path, cache, tokenizer, kind):
    """A file whose first bytes are a UTF-8 byte order mark loads exactly as the same file without it (as Python's
    json reads the bytes: json.loads(BOM + line) is the line's object), a BOM alone on line 1 makes a blank line;
    a BOM starting a later line (files joined together) is a bad line that says what to do."""
    lines = [json.dumps(GOOD[kind]).encode(), json.dumps(GOOD[kind]).encode()]
    plain, marked, alone = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl", tmp_path / "alone.jsonl"
    plain.write_bytes(b"\n".join(lines) + b"\n")
    marked.write_bytes(BOM + b"\n".join(lines) + b"\n")
    alone.write_bytes(BOM + b"\n" + b"\n".join(lines) + b"\n")
    assert json.loads(BOM + lines[0]) == GOOD[kind]
    expected = LOADERS[kind](plain, tokenizer, MAX_SEQ_LEN[kind], cache_dir=cache)
    for path in (marked, alone):
        loaded = LOADERS[kind](path, tokenizer, MAX_SEQ_LEN[kind], cache_dir=cache)
        assert loaded.stats == expected.stats
        assert [loaded[i]["input_ids"].tolist() for i in range(len(loaded))] == \
            [expected[i]["input_ids"].tolist() for i in range(len(expected))]
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes(marked.read_bytes() + BOM + lines[0] + b"\n")
    with pytest.raises(ValueError) as info:
        LOADERS[kind](joined, tokenizer, MAX_SEQ_LEN[kind], cache_dir=cache)
    message = str(info.value)
    assert message == (f"{joined}:3: a byte order mark (U+FEFF) starts the line, and only the file's first line may "
                       "begin with one: remove it (joining files keeps each one's mark)"), message
    assert LOADERS[kind](joined, tokenizer, MAX_SEQ_LEN[kind], skip_bad_lines=True,
                         cache_dir=cache).stats["skipped_lines"] == 1


def test_every_jsonl_reader_reads_past_a_leading_byte_order_mark(tmp_path, tokenizer):
    """The prompt files of GRPO/PPO, the line iterator of the tokenizer and probes, and evaluate's kind detection
    read line 1 past the mark too."""
    from dataset.prompt_dataset import PromptDataset
    from eval.evaluate import detect_kind
    prompts, texts = tmp_path / "prompts.jsonl", tmp_path / "texts.jsonl"
    prompts.write_bytes(BOM + b'{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    texts.write_bytes(BOM + b'{"text": "hello"}\n{"text": "again"}\n')
    data = PromptDataset(prompts, tokenizer, max_seq_len=64)
    assert [data[i]["prompt"] for i in range(len(data))] == ["What is 1 + 1?"]
    assert [record for _, record, _ in dataset.jsonl.iter_records(texts, "text")] == [{"text": "hello"},
                                                                                       {"text": "again"}]
    assert detect_kind(texts) == "pretrain"


def test_only_one_byte_order_mark_is_read_past():
    """The file's own mark is taken off line 1 once: a second one after it (a marked file pasted into a marked
    file) is content, a bad line, not a longer mark to strip."""
    lines = [BOM + BOM + b'{"text": "hello"}\n', b'{"text": "again"}\n']
    assert list(dataset.jsonl.numbered_lines(lines)) == [(1, BOM + b'{"text": "hello"}\n'), (2, lines[1])]
    with pytest.raises(dataset.jsonl.BadLine, match="byte order mark"):
        dataset.jsonl.parse_line(BOM + b'{"text": "hello"}\n')


def test_a_data_file_that_cannot_be_read_is_one_line(tmp_path):
    """A file whose read fails (/proc/self/mem: an I/O error at the first read; a file of another user: permission
    denied) was an OSError traceback once the run had started (found by fuzzing the flags); both readers, the
    trainers' scan and the tools' record iterator, name the file and the reason in one line."""
    unreadable = tmp_path / "mem.jsonl"
    unreadable.symlink_to("/proc/self/mem")
    with pytest.raises(ValueError) as scanned:
        dataset.jsonl.scan_jsonl(unreadable, "text", cache_dir=tmp_path / "cache")
    assert str(scanned.value) == f"{unreadable}: cannot be read (Input/output error)"
    with pytest.raises(ValueError) as iterated:
        list(dataset.jsonl.iter_records(unreadable, "text"))
    assert str(iterated.value) == f"{unreadable}: cannot be read (Input/output error)"


def test_a_data_file_that_cannot_be_opened_is_refused_by_the_check_before_the_work(tmp_path):
    """check_data_file (the trainers' and tools' check before any work) opens the file: one that cannot be opened
    for reading is its one line there. /proc/sys/vm/drop_caches is a write-only file (mode 0200) that even root
    cannot open for reading, where a file of mode 000 would be read by root."""
    unopenable = tmp_path / "data.jsonl"
    unopenable.symlink_to("/proc/sys/vm/drop_caches")
    assert unopenable.is_file()
    with pytest.raises(ValueError) as checked:
        dataset.jsonl.check_data_file(unopenable)
    assert str(checked.value) == f"{unopenable}: cannot be read (Permission denied)"


CALL = {"role": "assistant", "content": None, "tool_calls": [{"name": "calculator", "arguments": {"expression": "1"}}]}
RESULT = {"role": "tool", "content": "1"}


@pytest.mark.parametrize("messages, index", [
    ([CHAT[0], RESULT, CHAT[1]], 1),  # the assistant's call turn dropped (a converter dropping null contents)
    ([RESULT, CHAT[1]], 0),
    ([CHAT[0], CALL, RESULT, CHAT[1], CHAT[0], RESULT, CHAT[1]], 5),  # a second result, after the exchange ended
])
def test_a_tool_result_that_answers_no_call_is_a_bad_line(tmp_path, cache, tokenizer, messages, index):
    """It rendered as a user turn holding a <tool_response> and trained the answer after it on a call never made."""
    from dataset.prompt_dataset import PromptDataset

    reason = (f'[{index}] is a tool result with no tool call before it: a "tool" message follows an assistant message '
              f"with tool_calls, or another tool result")
    rows = {"conversations": {"conversations": messages},
            "preference": {"chosen": messages, "rejected": messages[:-1] + [{"role": "assistant", "content": "No."}]}}
    for kind, row in rows.items():
        path = write_jsonl(tmp_path / f"{kind}.jsonl", [GOOD[kind], row])
        with pytest.raises(ValueError) as refused:
            LOADERS[kind](path, tokenizer, 64, cache_dir=cache)
        assert str(refused.value) == f"{path}:2: {'chosen' if kind == 'preference' else kind}{reason}"
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Hi"}, {"messages": messages}])
    with pytest.raises(ValueError) as refused:
        PromptDataset(path, tokenizer, 64)
    assert str(refused.value).startswith(f"{path}:2: messages{reason}")


def test_tool_results_after_a_call_are_read(tmp_path, cache, tokenizer):
    """Two results after one turn's calls, and a pair whose explicit prompt ends with the call (its answers begin
    with the result)."""
    two_calls = {**CALL, "tool_calls": CALL["tool_calls"] * 2}
    path = write_jsonl(tmp_path / "sft.jsonl", [{"conversations": [CHAT[0], two_calls, RESULT, RESULT, CHAT[1]]}])
    assert SFTDataset(path, tokenizer, 128, cache_dir=cache).stats["samples"] == 1
    pair = {"prompt": [CHAT[0], CALL], "chosen": [RESULT, CHAT[1]],
            "rejected": [RESULT, {"role": "assistant", "content": "No."}]}
    path = write_jsonl(tmp_path / "dpo.jsonl", [pair])
    assert DPODataset(path, tokenizer, 128, cache_dir=cache).stats["pairs"] == 1
