"""eval/evaluate.py: its numbers against losses computed here independently, its CLI and its JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from eval.evaluate import FIXED_PROMPTS, detect_kind, evaluate_model_dir, main
from model.loading import load_model


def test_pretrain_perplexity_is_exp_of_mean_token_loss(tiny_models, tokenizer) -> None:
    seq_len = 16
    report = evaluate_model_dir(tiny_models.pretrain, [str(tiny_models.pretrain_data)], max_seq_len=seq_len,
                                batch_size=3)
    result = report["results"]["pretrain"]
    # Independently: every document followed by eos, one stream, cut into rows of seq_len, each row scored alone.
    stream: list[int] = []
    for line in tiny_models.pretrain_data.read_text(encoding="utf-8").splitlines():
        stream += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rows = [stream[i:i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
    assert len(rows) % 3  # the last batch is short: the mean must be token-weighted, not batch-weighted
    model, _ = load_model(tiny_models.pretrain)
    nats, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row])
            logits = model(ids).logits[0]
            nats += F.cross_entropy(logits[:-1].double(), ids[0, 1:], reduction="sum").item()
            count += len(row) - 1
    assert result["kind"] == "pretrain" and result["tokens"] == count
    assert result["loss"] == pytest.approx(nats / count, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nats / count), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(nats / math.log(2) / result["bytes"], rel=1e-6)
    assert result["bytes"] > result["tokens"]  # byte-level BPE tokens of real text average over one byte
    assert report["task"] == "pretrain" and report["max_seq_len"] == seq_len


def test_sft_loss_covers_only_assistant_tokens(tiny_models, tokenizer) -> None:
    report = evaluate_model_dir(tiny_models.sft, [str(tiny_models.sft_data)], max_seq_len=64, batch_size=4)
    result = report["results"]["sft"]
    model, _ = load_model(tiny_models.sft)
    nats, count = 0.0, 0
    with torch.no_grad():
        for line in tiny_models.sft_data.read_text(encoding="utf-8").splitlines():
            user, assistant = json.loads(line)["conversations"]
            prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            answer_ids = tokenizer(assistant["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
            full = prompt_ids + answer_ids + tokenizer("\n", add_special_tokens=False)["input_ids"]
            assert full == tokenizer(prompt + assistant["content"] + "<|im_end|>\n",
                                     add_special_tokens=False)["input_ids"]
            logits = model(torch.tensor([full])).logits[0]
            # Position t predicts token t+1: the answer tokens are predicted from the positions just before them.
            start = len(prompt_ids)
            predicted = logits[start - 1:start - 1 + len(answer_ids)].double()
            nats += F.cross_entropy(predicted, torch.tensor(answer_ids), reduction="sum").item()
            count += len(answer_ids)
    assert result["kind"] == "sft" and result["tokens"] == count
    # The memorized replies cost ~0.003-0.02 nats a token: compare absolutely. Padded batches and single rows round
    # differently in fp32 (by 1.5e-5 in the mean on an AVX2-only CPU, whose kernels sum in another order); the exact
    # token count above is what catches a wrong mask.
    assert result["loss"] == pytest.approx(nats / count, rel=1e-5, abs=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)
    assert result["perplexity"] == pytest.approx(math.exp(nats / count), rel=1e-4)


def test_cli_prints_table_and_samples_and_writes_json(tiny_models, tmp_path, capsys, monkeypatch) -> None:
    import model.loading

    loads: list[dict] = []
    original_load = model.loading.load_model

    def recording_load(path, **kwargs):
        loads.append(kwargs)
        return original_load(path, **kwargs)

    monkeypatch.setattr(model.loading, "load_model", recording_load)
    out = tmp_path / "report.json"
    code = main(["--model_path", str(tiny_models.sft), "--data", str(tiny_models.sft_data),
                 str(tiny_models.pretrain_data), "--max_seq_len", "32", "--json", str(out), "--device", "cpu"])
    printed = capsys.readouterr().out
    assert code == 0
    # The samples reuse the evaluated model and --device.
    assert loads == [{"device": "cpu", "dtype": "float32", "lora": None}]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert set(report["results"]) == {"sft", "pretrain"}
    assert report["results"]["sft"]["kind"] == "sft" and report["results"]["pretrain"]["kind"] == "pretrain"
    for name, result in report["results"].items():
        assert name in printed and f"{result['loss']:.4f}" in printed
    prompts = [sample["prompt"] for sample in report["samples"]]
    assert prompts == list(FIXED_PROMPTS["sft"]) and any("\u4e00" <= ch <= "\u9fff" for ch in "".join(prompts))
    answers = {sample["prompt"]: sample["answer"] for sample in report["samples"]}
    assert answers["What is the capital of France?"] == tiny_models.reply  # a training question, greedy
    assert f"What is the capital of France? -> {tiny_models.reply}" in printed


@pytest.mark.parametrize("world", [1, 3])
def test_each_process_evaluates_its_own_samples_once(tiny_models, tokenizer, world) -> None:
    from types import SimpleNamespace

    from eval.evaluate import _eval_loader
    from trainer.data import dataset_class

    dataset = dataset_class("pretrain")(tiny_models.pretrain_data, tokenizer, 16)
    assert len(dataset) % world or world == 1  # uneven shards: they are padded to equal length
    rows, batches = [], []
    for rank in range(world):
        loader = _eval_loader(dataset, 2, SimpleNamespace(process_index=rank, num_processes=world))
        batches.append(len(loader))
        for batch in loader:
            for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
                if (labels != -100).any():  # the padding samples carry no target: they count nowhere
                    rows.append(ids.tolist())
    assert len(set(batches)) == 1  # every process runs the same number of forward passes (a collective under FSDP)
    assert sorted(rows) == sorted(dataset[i]["input_ids"].tolist() for i in range(len(dataset)))


def test_dataset_kind_comes_from_the_first_line(tmp_path) -> None:
    text, chat, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    text.write_text('\n{"text": "hello"}\n')
    chat.write_text('{"conversations": [{"role": "user", "content": "hi"}]}\n')
    bad.write_text('{"prompt": "hi"}\n')
    assert detect_kind(text) == "pretrain" and detect_kind(chat) == "sft"
    with pytest.raises(ValueError, match='c.jsonl:1: expected a "text" or a "conversations" field'):
        detect_kind(bad)


def test_cli_errors_are_one_line(tmp_path, capsys) -> None:
    assert main(["--model_path", str(tmp_path / "missing"), "--no_samples"]) == 2
    assert "python trainer/train_full_sft.py" in capsys.readouterr().err


def _byte_tokens(tokenizer, data: bytes) -> list[int]:
    """One byte-level token per byte (every byte is in a byte-level BPE vocabulary)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char_of_byte = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([char_of_byte[byte] for byte in data])


def test_answers_show_bytes_that_are_not_utf8_as_escapes(tiny_models, tokenizer, capsys, monkeypatch) -> None:
    """Characters split over byte tokens decode whole; bytes that form no character (the start of 你 without its
    end, a lone continuation byte) show as \\xNN, where decode shows U+FFFD, and the output says what they are."""
    from eval.evaluate import answer_text
    from model.chat_session import ChatSession, Reply

    split = _byte_tokens(tokenizer, "你好".encode())
    assert answer_text(tokenizer, split) == tokenizer.decode(split) == "你好"
    text = "Hello 世界, the moon!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert answer_text(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True) == text
    broken = _byte_tokens(tokenizer, "你".encode() + "你".encode()[:2] + "好".encode() + b"\xa0")
    assert tokenizer.decode(broken) == "你\ufffd好\ufffd"  # what the answers showed before
    assert answer_text(tokenizer, broken) == "你\\xe4\\xbd好\\xa0"

    def reply(self, user_text, on_text=None):
        return Reply(text=tokenizer.decode(broken), new_tokens=len(broken), seconds=1.0, stopped_at_eos=False,
                     token_ids=list(broken))

    monkeypatch.setattr(ChatSession, "reply", reply)
    assert main(["--model_path", str(tiny_models.sft), "--data", str(tiny_models.sft_data), "--max_seq_len", "32",
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "你好，你是谁？ -> 你\\xe4\\xbd好\\xa0" in printed and "\ufffd" not in printed
    assert f"({3 * len(FIXED_PROMPTS['sft'])} \\xNN: bytes the model emitted that form no UTF-8 character" in printed


@pytest.mark.parametrize("flags, message", [
    (["--max_batches", "-1"], "argument --max_batches: -1 is not an integer >= 0 (0: all)"),
    (["--batch_size", "0"], "argument --batch_size: 0 is not an integer >= 1"),
    (["--max_seq_len", "0"], "argument --max_seq_len: 0 is not an integer >= 1"),
    (["--json", "."], "argument --json: . is a directory, expected a file"),
    (["--device", "cuda:7"], "argument --device: expected auto or cpu, got 'cuda:7'"),
    (["--device", "gpu"], "argument --device: expected auto or cpu, got 'gpu'"),
])
def test_bad_flags_are_refused_before_any_work(flags, message, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--model_path", str(tmp_path / "missing"), "--no_samples", *flags])  # no model: parsing comes first
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"


@pytest.mark.parametrize("line, reason", [
    ('{"x": ' + "[" * 1200 + "]" * 1200 + ', "text": "a"}', "nested too deeply"),
    ('{"text": ' + "7" * 5000 + "}", "integer"),
    (b'{"text": "\xff"}', "not valid UTF-8"),
])
def test_the_first_line_is_read_as_the_datasets_read_it(tmp_path, line, reason) -> None:
    """The kind comes from the strict reader too: a line it refuses is one line naming the file and line (it was a
    RecursionError's traceback, or a codec's message naming no file)."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n" + (line if isinstance(line, bytes) else line.encode()) + b"\n")
    with pytest.raises(ValueError, match=rf"d\.jsonl:2: .*{reason}"):
        detect_kind(path)


def test_files_of_one_stem_each_get_a_row(tiny_models, tmp_path, capsys) -> None:
    """a/val.jsonl and b/val.jsonl: both were named "val", and the second result replaced the first."""
    import shutil

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    shutil.copy(tiny_models.pretrain_data, tmp_path / "a" / "val.jsonl")
    shutil.copy(tiny_models.sft_data, tmp_path / "b" / "val.jsonl")
    given = [str(tmp_path / "a" / "val.jsonl"), str(tmp_path / "b" / "val.jsonl")]
    out = tmp_path / "report.json"
    assert main(["--model_path", str(tiny_models.sft), "--data", *given, str(tiny_models.pretrain_data),
                 "--max_seq_len", "32", "--no_samples", "--json", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text(encoding="utf-8"))["results"]
    assert list(results) == [*given, "pretrain"]  # a stem of its own stays the short name
    assert [results[name]["kind"] for name in given] == ["pretrain", "sft"]
    assert all(name in printed for name in given)
    # One file given twice is refused, naming both spellings, before any work.
    twice = str(tmp_path / "a" / ".." / "a" / "val.jsonl")
    assert main(["--model_path", str(tiny_models.sft), "--data", given[0], twice, "--no_samples"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the threads line
    assert err.startswith("error: ") and f"--data {given[0]} and {twice} are the same file" in err, err


@pytest.mark.parametrize("recorded, splits", [
    ("task: sft\nmax_seq_len: 384\n", ("pretrain_val", "sft_tools_val")),  # the default SFT: the tool dialogues
    ("task: sft\nsft_data: tools\n", ("pretrain_val", "sft_tools_val")),
    ("task: sft\nsft_data: chat\n", ("pretrain_val", "sft_val")),
    ("task: sft\ndata_path: my.jsonl\n", ("pretrain_val", "sft_val")),
    ("task: lora\n", ("pretrain_val", "lora_val")),
    ("task: pretrain\n", ("pretrain_val", "sft_val")),
    (None, ("pretrain_val", "sft_val")),
])
def test_the_default_splits_are_the_ones_the_run_validated_on(recorded, splits, tmp_path) -> None:
    """evaluate.py on the README's out/sft scored sft_val at 256 tokens: loss 6.38, against the 5.39 its run
    reported on sft_tools_val at 384, with nothing saying why (a newcomer's walk)."""
    from eval.evaluate import default_splits

    if recorded is not None:
        (tmp_path / "train_config.yaml").write_text(recorded)
    assert default_splits(tmp_path) == splits


def test_rows_default_to_the_length_the_run_trained_on(tiny_models, tmp_path) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_models.pretrain, model)
    (model / "train_config.yaml").write_text("task: pretrain\nmax_seq_len: 12\n")
    data = [str(tiny_models.pretrain_data)]
    assert evaluate_model_dir(model, data)["max_seq_len"] == 12
    assert evaluate_model_dir(model, data, max_seq_len=16)["max_seq_len"] == 16


@pytest.mark.parametrize(("recorded", "shown"), [("'12'", "'12'"), ("0", "0"), ("-12", "-12"), ("12.5", "12.5"),
                                                ("null", "None")])
def test_a_damaged_recorded_length_is_one_line_naming_the_file(tiny_models, tmp_path, capsys, recorded,
                                                               shown) -> None:
    """A train_config.yaml whose max_seq_len was edited into no length was read as none recorded: the model was
    scored at pretraining's default rows without a word. Now one line names the file and field; a --max_seq_len
    given reads no recorded one (nor does the tool without --rope_scaling_factor)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_models.pretrain, model)
    (model / "train_config.yaml").write_text(f"task: pretrain\nmax_seq_len: {recorded}\n")
    flags = ["--model_path", str(model), "--data", str(tiny_models.pretrain_data), "--no_samples", "--device", "cpu",
             "--threads", "1"]
    assert main(flags) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {model / 'train_config.yaml'}: max_seq_len is {shown}, expected an integer >= 1 (the run's "
        f"--max_seq_len: the tools read the model at the rows it trained on); repair it")
    assert main([*flags, "--max_seq_len", "12"]) == 0


def test_a_model_that_records_no_length_is_scored_in_pretrainings_default_rows(tiny_models, monkeypatch) -> None:
    """The rows of a model whose runs recorded no --max_seq_len (an imported checkpoint) are pretraining's default
    --max_seq_len, read from its owner (trainer/arg_fields.py), where evaluate.py kept a 256 of its own."""
    import trainer.arg_fields

    data = [str(tiny_models.pretrain_data)]  # tiny_models.pretrain records its task only, 128 positions
    monkeypatch.setitem(trainer.arg_fields.FLAG_DEFAULTS, "max_seq_len", 12)
    assert evaluate_model_dir(tiny_models.pretrain, data, with_samples=False)["max_seq_len"] == 12
    assert evaluate_model_dir(tiny_models.pretrain, data, rope_scaling_factor=2.0)["max_seq_len"] == 24


def test_a_sample_prompt_too_long_for_the_context_is_one_line_naming_it(tiny_models, tokenizer, tmp_path,
                                                                        capsys) -> None:
    """A 16-position SFT model scored on pretraining text: the losses fit, the first sample prompt in the chat
    format does not. The line said only "takes 23 tokens ... context of 16", not which text took them."""
    import shutil

    from dataset.chat_format import encode_chatml
    from tests.conftest import _save_tiny, _tiny_model

    short = _save_tiny(_tiny_model(tokenizer, seed=0, max_position_embeddings=16).eval(), tokenizer,
                       tmp_path / "short", "sft")
    shutil.copy(tiny_models.pretrain_data, tmp_path / "texts.jsonl")
    prompt = FIXED_PROMPTS["sft"][0]
    tokens = len(encode_chatml(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True).input_ids)
    assert tokens >= 16
    code = main(["--model_path", str(short), "--data", str(tmp_path / "texts.jsonl"), "--threads", "1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and err == [f"error: the sample prompt {prompt!r} takes {tokens} tokens in the chat format, over "
                                 "the model's context of 16; --no_samples leaves the greedy answers out"], err


def test_rows_longer_than_the_models_positions_are_lowered_with_a_note(tiny_models, tmp_path, capsys,
                                                                      monkeypatch) -> None:
    """The tiny model has 128 positions: --max_seq_len 512 scores rows of 128, saying so on stderr in one line (the
    header alone said 128); 128 itself is no note, and a default longer than the context is lowered with one too."""
    import trainer.arg_fields

    text = tmp_path / "val.jsonl"  # the tiny texts three times over: more than one row of 128 tokens
    text.write_text(tiny_models.pretrain_data.read_text(encoding="utf-8") * 3, encoding="utf-8")
    data = ["--data", str(text), "--no_samples", "--device", "cpu"]
    for asked, note in [("512", "note: max_seq_len 512 (asked) lowered to 128, the model's max_position_embeddings: "
                                "longer rows would be scored past its context"), ("128", None)]:
        assert main(["--model_path", str(tiny_models.pretrain), *data, "--max_seq_len", asked]) == 0
        captured = capsys.readouterr()
        assert "max_seq_len 128\n" in captured.out
        assert [line for line in captured.err.splitlines() if line.startswith("note: ")] == ([note] if note else [])
        assert "Traceback" not in captured.err
    monkeypatch.setitem(trainer.arg_fields.FLAG_DEFAULTS, "max_seq_len", 300)  # a model that records no length
    report = evaluate_model_dir(tiny_models.pretrain, [str(text)], device="cpu")
    assert report["max_seq_len"] == 128
    assert "note: max_seq_len 300 (the default) lowered to 128" in capsys.readouterr().err
