"""eval/long_context.py: its per-bucket losses against losses computed here from models loaded with each
rope_scaling in their config (transformers' own path), and its one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from eval.long_context import main, parse_scaling

LENGTH, BUCKET = 48, 16


def reference_buckets(path, documents: list[list[int]], **config) -> list[float]:
    """Mean fp64 next-token loss per bucket of positions, each document scored alone."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config).eval()
    per_position = torch.zeros(LENGTH, dtype=torch.float64)
    with torch.no_grad():
        for ids in documents:
            ids = torch.tensor([ids])
            logits = model(input_ids=ids[:, :-1]).logits[0].double()
            per_position += F.cross_entropy(logits, ids[0, 1:], reduction="none")
    return [float(chunk.mean()) for chunk in (per_position / len(documents)).split(BUCKET)]


def test_bucket_losses_equal_models_loaded_with_each_scaling(tiny_models, tokenizer, tmp_path) -> None:
    texts = ["The river runs past the old mill and the bridge. " * 12, "Numbers: " + " ".join(map(str, range(80))),
             "Too short to count."]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    out = tmp_path / "table.json"
    assert main(["--model_path", str(tiny_models.pretrain), "--data", str(data), "--length", str(LENGTH),
                 "--bucket", str(BUCKET), "--scalings", "none,yarn:4@16,linear:2,dynamic:4@16", "--batch_size", "2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    documents = [tokenizer(text, add_special_tokens=False)["input_ids"][:LENGTH + 1] for text in texts[:2]]
    assert report["documents"] == 2 and report["bucket_starts"] == [0, 16, 32]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    expected = {
        "none": reference_buckets(tiny_models.pretrain, documents),
        "yarn:4@16": reference_buckets(tiny_models.pretrain, documents, rope_scaling=yarn,
                                       max_position_embeddings=64),
        "linear:2": reference_buckets(tiny_models.pretrain, documents,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "dynamic:4@16": reference_buckets(tiny_models.pretrain, documents,
                                          rope_scaling={"rope_type": "dynamic", "factor": 4.0},
                                          max_position_embeddings=16),
    }
    for label, losses in expected.items():
        assert report["losses"][label] == pytest.approx(losses, rel=1e-5), label
    # The rows differ: each scaling reached the model.
    rows = [tuple(round(loss, 6) for loss in report["losses"][label]) for label in expected]
    assert len(set(rows)) == len(rows)


@pytest.mark.parametrize("spec", ["yarn", "yarn:x", "yarn:1", "rope:4", "yarn:4@", "yarn:4@-3", "linear:0.5",
                                  "yarn:inf", "yarn:nan", "linear:1e308", "dynamic:inf", "yarn:1e307@256",
                                  "yarn:2@" + "9" * 400, "yarn:2@16777217", "yarn:2@0", "dynamic:1.0"])
def test_bad_scaling_items_are_refused_in_one_line(spec: str) -> None:
    with pytest.raises(ValueError, match=r"--scalings item .* use none or TYPE:FACTOR\[@L\]") as error:
        parse_scaling(spec, 128)
    assert "\n" not in str(error.value)


def test_a_long_scaling_item_is_quoted_cut_in_one_short_line() -> None:
    """The item and its FACTOR are quoted as every refusal quotes a value (dataset/shown_value.py: the repr cut at
    MAX_SHOWN characters): a 5,000-character item made a 10,000-character line."""
    from dataset.shown_value import MAX_SHOWN

    with pytest.raises(ValueError) as error:
        parse_scaling("yarn:" + "x" * 5000, 128)
    item, factor = "'yarn:" + "x" * (MAX_SHOWN - 9) + "...", "'" + "x" * (MAX_SHOWN - 4) + "..."
    assert str(error.value).startswith(f"--scalings item {item} is not allowed: FACTOR {factor} is not a number; "
                                       f"use none or TYPE:FACTOR[@L]"), str(error.value)[:300]
    assert len(str(error.value)) < 400


@pytest.mark.parametrize("spec, shown", [("yarn:1e30", "1e+30"), ("dynamic:1e30", "1e+30"), ("linear:1025", "1025"),
                                         ("linear:0", "0"), ("yarn:-4@256", "-4"), ("yarn:nan", "nan"),
                                         ("dynamic:inf", "inf")])
def test_an_absurd_factor_is_refused_naming_it_and_the_range_before_the_model_loads(spec, shown, tiny_models,
                                                                                   monkeypatch, capsys) -> None:
    """A finite factor far past any context extension (yarn:1e30 extended max_position_embeddings past 10^32 and
    scored a row), and one <= 1, NaN or inf, are refused in one line naming the value and the range, before the
    model is loaded (they were refused, or not, after loading it); the largest allowed factor is taken."""
    import model.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model.loading, "load_model", no_loading)
    assert main(["--model_path", str(tiny_models.pretrain), "--scalings", f"none,{spec}"]) != 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --scalings item {spec!r} is not allowed: FACTOR {shown} is not in (1, 1024]; use none or "
        f"TYPE:FACTOR[@L] with TYPE one of yarn, linear, dynamic, FACTOR a number in (1, 1024] and L an integer in "
        f"1 .. 16777216 (e.g. yarn:4@256)")
    assert parse_scaling("yarn:1024@256", 128).max_position_embeddings == 1024 * 256


def test_the_ends_of_the_length_range_are_taken() -> None:
    """L = 1 and L = 2^24 are the range's ends, taken as given (L = 0 and 2^24 + 1 are refused above), and a factor
    just above 1 is one: a bound one step too tight would refuse them."""
    assert parse_scaling("yarn:2@1", 128).rope_scaling == {"rope_type": "yarn", "factor": 2.0,
                                                           "original_max_position_embeddings": 1}
    assert parse_scaling("yarn:2@1", 128).max_position_embeddings == 2
    assert parse_scaling(f"dynamic:2@{2 ** 24}", 128).max_position_embeddings == 2 ** 24
    assert parse_scaling(f"linear:1.5@{2 ** 24}", 128).max_position_embeddings == 3 * 2 ** 23
    assert parse_scaling("linear:1.0001", 128).rope_scaling == {"rope_type": "linear", "factor": 1.0001}


def test_no_long_enough_document_is_one_line(tiny_models, tmp_path, capsys, monkeypatch, tokenizer) -> None:
    """Said before the model loads, with the longest document's tokens, and without tokenizing the documents whose
    length proves them too short (--length 1000000 read a large file to its end, tokenizing every document)."""
    import dataset.pretrain_dataset as pretrain_dataset
    import model.loading as loading
    from dataset.chat_format import encode_text

    texts = ["short", "a somewhat longer text, still short", "mid length"]
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    tokenized = []
    encode = pretrain_dataset.encode_documents
    monkeypatch.setattr(pretrain_dataset, "encode_documents",
                        lambda tok, docs: tokenized.extend(docs) or encode(tok, docs))
    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    assert main(["--model_path", str(tiny_models.pretrain), "--data", str(data), "--length", "64"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --data {data}: no document has more than --length 64 tokens; the longest (line 2, 35 characters) "
        f"has {len(encode_text(tokenizer, texts[1]))}")
    assert tokenized == [texts[1]]  # for the count the line gives, once


def test_the_documents_kept_are_every_one_long_enough(tmp_path, tokenizer) -> None:
    """Skipping the documents whose length proves them too short keeps the same documents as tokenizing each."""
    from dataset.chat_format import encode_text
    from eval.long_context import long_documents

    pieces = ("word ", "\u00e9", "\U0001F600", " ", "a1", "<|im_end|>")
    texts = [piece * count for piece in pieces for count in range(1, 40)]
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    for length in (8, 20, 39, 40, 41):
        expected = [ids[:length + 1] for ids in map(lambda text: encode_text(tokenizer, text), texts)
                    if len(ids) > length]
        assert long_documents(data, tokenizer, length, 0) == expected


@pytest.mark.parametrize("name, message", [("folder", "{path} is a folder, not a jsonl data file"),
                                           ("missing.jsonl", "no such data file: {path}")])
def test_a_data_path_that_is_no_file_is_one_line(name, message, tiny_models, tmp_path, capsys) -> None:
    """A folder was an IsADirectoryError traceback after the model loaded (found by fuzzing the flags), a missing
    file the bare '[Errno 2] No such file or directory'."""
    path = tmp_path / name
    if name == "folder":
        path.mkdir()
    assert main(["--model_path", str(tiny_models.pretrain), "--data", str(path), "--length", "64"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {message.format(path=path)}"


@pytest.mark.parametrize("flag, value, allowed", [("--bucket", "0", ">= 1"), ("--length", "-5", "in 1 .. 16777216"),
                                                  ("--batch_size", "0", ">= 1"), ("--max_documents", "-3", ">= 0"),
                                                  ("--length", str(2 ** 24 + 1), "in 1 .. 16777216")])
def test_counts_out_of_range_are_one_line(flag, value, allowed, capsys) -> None:
    """--bucket 0 was a RuntimeError traceback from torch's split, --length 0 a table of nan, --batch_size 0
    range()'s message naming no flag, --max_documents -3 taken silently."""
    with pytest.raises(SystemExit) as stopped:
        main([flag, value])
    assert stopped.value.code == 2
    assert f"argument {flag}: {value} is not an integer {allowed}" in capsys.readouterr().err


def test_documents_are_read_as_pretraining_reads_text(tmp_path, tokenizer) -> None:
    """A document that writes <|im_end|> is scored on those characters, as the model trained on them (text is
    text), in long_context.py and copy_probe.py alike."""
    from dataset.chat_format import encode_text
    from eval.copy_probe import text_rows
    from eval.long_context import long_documents

    text = "The end marker <|im_end|> and <|endoftext|> are written here. " * 8
    data = tmp_path / "text.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    ids = encode_text(tokenizer, text)
    assert long_documents(data, tokenizer, 40, 0) == [ids[:41]]
    assert text_rows(data, tokenizer, 40, 1) == [ids[:40]]


RIVER = "The river runs past the old mill and the bridge. " * 12


def recorded_model(tiny_models, tmp_path, recorded: int | None):
    """(a copy of the tiny pretrained model whose run recorded --max_seq_len `recorded` (None: no max_seq_len line;
    a null one is a damaged file), a jsonl of one long document)."""
    import shutil

    import yaml

    from trainer.run_dir import CONFIG_FILE

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_models.pretrain, model_dir)
    length = {} if recorded is None else {"max_seq_len": recorded}
    (model_dir / CONFIG_FILE).write_text(yaml.safe_dump({"task": "pretrain", **length}))
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": RIVER}) + "\n", encoding="utf-8")
    return model_dir, data


@pytest.mark.parametrize("recorded, flag, marked_from", [(16, [], 16), (None, [], None),
                                                         (16, ["--trained_length", "32"], 32)])
def test_the_marked_buckets_start_at_the_length_the_run_recorded(tiny_models, tmp_path, capsys, recorded, flag,
                                                                 marked_from) -> None:
    """The * marks start at the --max_seq_len the model's run recorded (as --rope_scaling_factor reads it), not at a
    256 of the tool's own; --trained_length overrides it, and a model that records none is marked from its
    max_position_embeddings (128 here: no bucket)."""
    model_dir, data = recorded_model(tiny_models, tmp_path, recorded)
    assert main(["--model_path", str(model_dir), "--data", str(data), "--length", str(LENGTH), "--bucket",
                 str(BUCKET), "--scalings", "none", *flag]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| scaling"))
    starts = range(0, LENGTH, BUCKET)
    expected = [f"{start}-{start + BUCKET - 1}{'*' if marked_from is not None and start >= marked_from else ''}"
                for start in starts]
    assert header == "| " + " | ".join(["scaling", *expected]) + " |"


@pytest.mark.parametrize("recorded, flag, trained", [(16, [], 16), (16, ["--trained_length", "32"], 32),
                                                     (None, [], 128)])
def test_the_default_scalings_take_the_trained_length(tiny_models, tokenizer, tmp_path, recorded, flag,
                                                      trained) -> None:
    """Without --scalings, the scalings over L are over the length that marks the buckets (the run's recorded one,
    --trained_length, else max_position_embeddings), not over a 256 of the tool's own: the rows say so, and the
    YaRN row equals the model loaded by transformers with original_max_position_embeddings = that length."""
    model_dir, data = recorded_model(tiny_models, tmp_path, recorded)
    out = tmp_path / "table.json"
    assert main(["--model_path", str(model_dir), "--data", str(data), "--length", str(LENGTH), "--bucket",
                 str(BUCKET), "--json", str(out), *flag]) == 0
    losses = json.loads(out.read_text())["losses"]
    assert list(losses) == ["none", f"yarn:4@{trained}", "yarn:2", f"dynamic:4@{trained}", f"linear:4@{trained}"]
    documents = [tokenizer(RIVER, add_special_tokens=False)["input_ids"][:LENGTH + 1]]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": trained}
    assert losses[f"yarn:4@{trained}"] == pytest.approx(
        reference_buckets(model_dir, documents, rope_scaling=yarn, max_position_embeddings=4 * trained), rel=1e-5)
