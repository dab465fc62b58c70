"""The committed tokenizer: ids of the special tokens, exact round trips, the ChatML template, and that
scripts/train_tokenizer.py regenerates the committed files. The template's tools, tool calls and thinking:
tests/unit/test_chat_template.py."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from dataset.chat_format import CHATML_TEMPLATE, render_chatml
from tests.paths import REPO

# Written out here, independently of dataset/chat_format.py's list: the ids are a contract with saved models.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>", "<think>", "</think>", "<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>",
           "<|reserved_3|>"]
EMPTY_THINK = "<think>\n\n</think>\n\n"
SHAPE = 'not {"files": [file names]} (with "writing": true while a save is under way)'  # tokenizer_files.json


ROUND_TRIP = [
    "The quick brown fox jumps over the lazy dog.",
    "Multiple   spaces,\ttabs\nand\n\nnewlines  ",
    "  leading and trailing whitespace  ",
    "人工智能是计算机科学的一个分支。你好，世界！",
    "Emoji 🤖🎉👍🏽, a family 👨‍👩‍👧‍👦 and a flag 🇫🇷.",
    "Mixed: café naïve Ωμέγα Привет مرحبا 日本語 한국어",
    "Code:\n    def f(x):\n        return x ** 2  # square\n",
    "\u200b zero width, \U0001f9ea test tube, \x00 nul and \x7f del",
]


def test_loads_with_auto_tokenizer_and_special_ids():
    tok = AutoTokenizer.from_pretrained(str(REPO / "model"))
    assert len(tok) == 6400
    assert tok.convert_tokens_to_ids(SPECIAL) == list(range(len(SPECIAL)))
    assert sorted(int(i) for i, t in tok.added_tokens_decoder.items() if t.special) == list(range(len(SPECIAL)))
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 0)
    assert tok.unk_token == "<|endoftext|>"
    assert tok.bos_token is None
    assert tok.is_fast
    # No bos/eos is added behind the user's back.
    assert tok("hello", add_special_tokens=True)["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_is_exact(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert 0 not in ids  # byte-level: never an unknown token


def test_special_tokens_are_single_tokens(tokenizer):
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 0 and ids.count(2) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    text = "<think>a</think><tool_call>b</tool_call><tool_response>c</tool_response><|reserved_3|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert [i for i in ids if i < len(SPECIAL)] == [7, 8, 3, 4, 5, 6, 12]
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_chatml_exactly(tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "什么是AI？"},
        {"role": "assistant", "content": "人工智能 🤖"},
    ]
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n" + EMPTY_THINK + "Hello, how can I help?<|im_end|>\n"
        "<|im_start|>user\n什么是AI？<|im_end|>\n"
        "<|im_start|>assistant\n" + EMPTY_THINK + "人工智能 🤖<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    assert tokenizer.apply_chat_template(messages[:4], tokenize=False, add_generation_prompt=True) == (
        expected[: expected.index("<|im_start|>assistant\n<think>\n\n</think>\n\n人工")] + "<|im_start|>assistant\n"
        + EMPTY_THINK
    )
    assert render_chatml(messages)[0] == expected


def test_chat_template_has_no_default_system_prompt(tokenizer):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK


def test_chat_template_token_ids(tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert ids == [1, *enc("user\n"), *enc("Hi"), 2, *enc("\n"), 1, *enc("assistant\n"), 7, *enc("\n\n"), 8,
                   *enc("\n\nYo"), 2, *enc("\n")]


def test_render_chatml_spans_cover_assistant_content_and_im_end():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
        {"role": "assistant", "content": ""},
    ]
    text, spans = render_chatml(messages)
    assert [text[a:b] for a, b in spans] == ["A1<|im_end|>", "<|im_end|>"]


def test_committed_config_holds_chat_template():
    config = json.loads((REPO / "model" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == CHATML_TEMPLATE
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"


def test_train_tokenizer_on_small_corpus(tmp_path):
    from scripts.train_tokenizer import main

    data = tmp_path / "pretrain.jsonl"
    texts = ["hello world, hello tokenizer", "你好世界", "emoji 🎉 party", "the the the cat sat"] * 50
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    main(["--vocab_size", "300", "--data_path", str(data), "--out_dir", str(tmp_path / "tok")])
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(tok) == 300
    assert tok.convert_tokens_to_ids(SPECIAL) == list(range(len(SPECIAL)))
    assert tok.chat_template == CHATML_TEMPLATE
    for text in ROUND_TRIP:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_train_tokenizer_writes_a_relative_out_dir_under_the_repo_root(tmp_path, monkeypatch):
    """`cd /tmp && train_tokenizer.py --out_dir tok`: --out_dir is relative to the repo root, as every output
    (trainer/cli.py output_folder); tokenizer.json was written in the current directory."""
    from scripts.train_tokenizer import main

    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    elsewhere.mkdir()
    data = tmp_path / "pretrain.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["hello world", "the cat sat"] * 20))
    monkeypatch.setattr("trainer.run_dir.REPO_ROOT", repo)
    monkeypatch.chdir(elsewhere)
    main(["--vocab_size", "300", "--data_path", str(data), "--out_dir", "tok"])
    assert (repo / "tok" / "tokenizer.json").is_file()
    assert not (elsewhere / "tok").exists()


@pytest.mark.parametrize("content, message", [
    (b"", "no text records"),
    (b"\n  \n", "no text records"),
    (b'{"text": "ok"}\n\xff\xfe\n', ":2: not valid UTF-8"),
    (b'{"text": "a\\ud800b"}\n', ":1: "),  # a lone surrogate: not text the tokenizer can encode
    (b"not json\n", ":1: invalid JSON"),
    (b'{"txt": "ok"}\n', ":1: "),
    (b'{"text": 5}\n', ":1: "),
], ids=["empty", "blank lines", "not UTF-8", "lone surrogate", "not JSON", "no text field", "text not a string"])
def test_train_tokenizer_refuses_bad_data_in_one_line(tmp_path, capsys, content, message):
    from scripts.train_tokenizer import main

    data = tmp_path / "pretrain.jsonl"
    data.write_bytes(content)
    assert main(["--vocab_size", "300", "--data_path", str(data), "--out_dir", str(tmp_path / "tok")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(data) in err and message in err, err
    assert not (tmp_path / "tok" / "tokenizer.json").exists()


@pytest.mark.parametrize("case", ["missing data", "data a directory", "out_dir a file", "out_dir under a file"])
def test_train_tokenizer_refuses_bad_paths_in_one_line(tmp_path, capsys, case):
    from scripts.train_tokenizer import main

    data = tmp_path / "pretrain.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    (tmp_path / "afile").write_text("x")
    data_path, out_dir, named = {
        "missing data": (tmp_path / "missing.jsonl", tmp_path / "tok", tmp_path / "missing.jsonl"),
        "data a directory": (tmp_path, tmp_path / "tok", tmp_path),
        "out_dir a file": (data, tmp_path / "afile", tmp_path / "afile"),
        "out_dir under a file": (data, tmp_path / "afile" / "tok", tmp_path / "afile"),
    }[case]
    try:
        code = main(["--vocab_size", "300", "--data_path", str(data_path), "--out_dir", str(out_dir)])
    except SystemExit as stopped:  # --out_dir is refused as the flags are parsed (trainer/cli.py output_folder)
        code = stopped.code
    assert code == 2
    error, *rest = capsys.readouterr().err.strip().splitlines()
    assert str(named) in error and all(line.endswith(": run with --help for the flags") for line in rest), rest
    assert len(rest) <= 1
    assert (tmp_path / "afile").read_text() == "x"


def test_train_tokenizer_refuses_a_models_folder_and_keeps_its_tokenizer(tmp_path, capsys, tiny_models):
    """A trained model's token ids are its tokenizer's: a new tokenizer written over it (found by fuzzing --out_dir
    with a model directory) left the model reading other tokens, the old tokenizer lost."""
    from scripts.train_tokenizer import main

    data = tmp_path / "pretrain.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    model = tmp_path / "model"
    shutil.copytree(tiny_models.pretrain, model)
    before = (model / "tokenizer.json").read_bytes()
    assert main(["--vocab_size", "300", "--data_path", str(data), "--out_dir", str(model)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --out_dir {model} holds a model (config.json and its weights), whose token ids are its tokenizer's: "
        f"a new tokenizer there would leave it reading other tokens; choose another --out_dir")
    assert (model / "tokenizer.json").read_bytes() == before


def test_train_tokenizer_retrains_a_folder_holding_only_a_tokenizer(tmp_path, capsys, tiny_models):
    """A tokenizer's own folder (as model/ is: tokenizer files, no config.json or weights) is no model, so a new
    tokenizer is written there as before; only a folder with a model's config.json and weights is refused."""
    from scripts.train_tokenizer import main

    data = tmp_path / "pretrain.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_models.pretrain / name, folder / name)
    (folder / "model.safetensors").write_bytes(b"")  # weights without a config.json: still no model
    before = (folder / "tokenizer.json").read_bytes()
    assert main(["--vocab_size", "300", "--data_path", str(data), "--out_dir", str(folder)]) == 0, capsys.readouterr()
    assert (folder / "tokenizer.json").read_bytes() != before


@pytest.mark.parametrize("vocab_size", ["0", "-5", "268", str(2**64), "many"])
def test_train_tokenizer_vocab_size_out_of_range_is_one_line(tmp_path, capsys, vocab_size):
    """Fewer than the 256 byte symbols and 13 special tokens cannot be: the trainer would silently make 269."""
    from scripts.train_tokenizer import main

    data = tmp_path / "pretrain.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--vocab_size", vocab_size, "--data_path", str(data), "--out_dir", str(tmp_path / "tok")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--vocab_size" in err and "269 .. " in err, err
    assert not (tmp_path / "tok").exists()


def test_train_tokenizer_trains_on_a_long_run_in_pieces(tmp_path, monkeypatch):
    """The BPE trainer's time grows with the square of a word's length: a line of 200,000 'a's took 38 s, a 50 MB
    one ran for over 10 minutes. A run of more than 1,000 non-space characters is given to it in pieces; the text
    around it, and every other text, whole."""
    import scripts.train_tokenizer as script

    texts = ["intro " + "a" * 2500 + " outro", "short text", "x" * 1000]
    data = tmp_path / "pretrain.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    trained = []
    real_train_bpe = script.train_bpe
    monkeypatch.setattr(script, "train_bpe", lambda pieces, vocab_size: real_train_bpe(
        iter(trained.extend(pieces) or trained), vocab_size))
    assert script.main(["--vocab_size", "300", "--data_path", str(data), "--out_dir", str(tmp_path / "tok")]) == 0
    assert trained == ["intro ", "a" * 1000, "a" * 1000, "a" * 500, " outro", "short text", "x" * 1000]


def test_script_regenerates_committed_tokenizer(tmp_path, default_corpus):
    """The committed files are exactly what the script produces from the default corpus."""
    from scripts.train_tokenizer import main

    main(["--data_path", str(default_corpus.pretrain_train), "--out_dir", str(tmp_path)])
    written = sorted(path.name for path in tmp_path.iterdir())
    assert written == ["tokenizer.json", "tokenizer_config.json", "tokenizer_files.json"], written
    for name in written:
        assert (tmp_path / name).read_bytes() == (REPO / "model" / name).read_bytes(), name


def _train_small_tokenizer(tmp_path, out_dir, text="hello world, hello tokenizer"):
    from scripts.train_tokenizer import main

    data = tmp_path / f"pretrain_{len(text)}.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    assert main(["--vocab_size", "300", "--data_path", str(data), "--out_dir", str(out_dir)]) == 0


def test_train_tokenizer_writes_its_files_jointly(tmp_path, monkeypatch):
    """train_tokenizer.py replaced its files one at a time with nothing to say so: a kill between two left the new
    tokenizer.json beside the old tokenizer_config.json, which loaded as a tokenizer neither run wrote. It now
    brackets them with the marker save_model_dir uses: a stopped write is refused at load in one line, a whole
    one loads and lists its files."""
    import scripts.train_tokenizer as script
    from dataset.tokenization import load_tokenizer

    out = tmp_path / "tok"
    _train_small_tokenizer(tmp_path, out)
    assert json.loads((out / "tokenizer_files.json").read_text(encoding="utf-8")) == {
        "files": ["tokenizer.json", "tokenizer_config.json"]}
    assert load_tokenizer(out).decode(load_tokenizer(out).encode("hello world")) == "hello world"

    real_copy, copied = script.shutil.copyfile, []

    def copy_then_die(source, target):
        if copied:
            raise KeyboardInterrupt  # the kill, after the first file is in place
        copied.append(target)
        return real_copy(source, target)

    monkeypatch.setattr(script.shutil, "copyfile", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        _train_small_tokenizer(tmp_path, out, "another text entirely, for another vocabulary")
    monkeypatch.setattr(script.shutil, "copyfile", real_copy)
    with pytest.raises(ValueError) as refused:
        load_tokenizer(out)
    assert str(refused.value).startswith(f"{out / 'tokenizer_files.json'}: a save of {out} stopped while it moved "
                                         f"its tokenizer files in"), refused.value
    assert "\n" not in str(refused.value)
    _train_small_tokenizer(tmp_path, out)  # writing it again is the way out
    load_tokenizer(out)


def test_fine_tuning_with_another_tokenizer_is_refused_in_one_line(tmp_path, tokenizer, tiny_models):
    """A model directory keeps the tokenizer it was trained with; training it further with another one (the default
    tokenizer after it changed, say) is refused before any step, naming both and the way out."""
    from trainer.args import parse_args
    from trainer.run_inputs import build_model

    args = parse_args("sft", ["--from_weight", str(tiny_models.pretrain)])
    model, _ = build_model(args, tokenizer, tiny_models.pretrain)
    assert model.config.vocab_size == len(tokenizer)  # its own tokenizer: accepted
    old = tmp_path / "old"
    old.mkdir()
    for name in ("config.json", "model.safetensors"):
        (old / name).write_bytes((tiny_models.pretrain / name).read_bytes())
    spec = json.loads((tiny_models.pretrain / "tokenizer.json").read_text(encoding="utf-8"))
    # Yesterday's layout: three special tokens, then ordinary pieces where <tool_call>... are today.
    spec["added_tokens"] = spec["added_tokens"][:3]
    (old / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    args = parse_args("sft", ["--from_weight", str(old)])
    with pytest.raises(ValueError, match=r"^--from_weight .*old: its tokenizer.json differs from the tokenizer in "
                                         r".*model.*--tokenizer_path .*old, or train it again"):
        build_model(args, tokenizer, old)


# ---------------------------------------------------------------- a model directory's tokenizer files, written jointly
def _two_tokenizers():
    """MiniNorm's tokenizer, and one that differs in what its files other than tokenizer.json hold (the chat
    template, the longest input): a file of one beside the other's loads as neither."""
    from dataset.tokenization import load_tokenizer

    first, second = load_tokenizer(None), load_tokenizer(None)
    second.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    second.model_max_length = 77
    return first, second


def _described(tokenizer) -> tuple:
    return tokenizer.chat_template, tokenizer.model_max_length, tokenizer.eos_token, len(tokenizer)


def _tiny_model():
    from model.config import MiniNormConfig
    from model.model import MiniNormForCausalLM

    return MiniNormForCausalLM(MiniNormConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                              num_key_value_heads=2))


def _save_stopped_after(stop_after, model, tokenizer, folder, monkeypatch) -> list:
    """save_model_dir of `tokenizer` into `folder`, killed when it has moved `stop_after` files into place: the
    files it moved."""
    import trainer.export as export

    real_replace, moved = export.os.replace, []

    def replace_then_die(source, target):
        if len(moved) == stop_after:
            raise KeyboardInterrupt  # the kill: nothing after it runs (the staging folder's removal aside)
        moved.append(target)
        real_replace(source, target)

    monkeypatch.setattr(export.os, "replace", replace_then_die)
    try:
        export.save_model_dir(model, tokenizer, folder)
    except KeyboardInterrupt:
        pass
    finally:
        monkeypatch.setattr(export.os, "replace", real_replace)
    return moved


def test_a_save_stopped_between_its_tokenizer_files_leaves_no_mix_that_loads(tmp_path, monkeypatch):
    """save_model_dir moves its files into place one by one: a kill between two left the new tokenizer_config.json
    beside the old chat_template.jinja (or the other way round), and the folder loaded as a tokenizer that neither
    save wrote, without a word. Every place the save can stop at: the folder loads as the old or the new tokenizer,
    or is refused in one line naming the marker."""
    import trainer.export as export
    from dataset.tokenization import load_tokenizer
    from model.loading import load_dir_tokenizer

    first, second = _two_tokenizers()
    model = _tiny_model()
    for stop_after in range(8):
        folder = tmp_path / f"stop_{stop_after}"
        export.save_model_dir(model, first, folder)
        moved = _save_stopped_after(stop_after, model, second, folder, monkeypatch)
        try:
            loaded = _described(load_tokenizer(folder))
            assert _described(load_dir_tokenizer(folder)) == loaded
        except ValueError as refused:
            assert str(refused).startswith(f"{folder / 'tokenizer_files.json'}: a save of {folder} stopped while it "
                                           f"moved its tokenizer files in"), refused
            assert "\n" not in str(refused)
            continue
        assert loaded in (_described(first), _described(second)), (stop_after, moved)


def test_a_save_removes_the_tokenizer_files_of_the_previous_save_it_does_not_write(tmp_path):
    """A run writing over an earlier one (--overwrite keeps the tokenizer files) with a tokenizer that has no chat
    template left the earlier chat_template.jinja, which the load then read as the new tokenizer's template."""
    from dataset.tokenization import load_tokenizer
    from trainer.export import save_model_dir

    first, plain = _two_tokenizers()
    plain.chat_template = None
    save_model_dir(_tiny_model(), first, tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    save_model_dir(_tiny_model(), plain, tmp_path)
    assert not (tmp_path / "chat_template.jinja").exists()
    assert load_tokenizer(tmp_path).chat_template is None


def test_a_folder_without_the_tokenizer_marker_loads_as_before(tmp_path):
    from dataset.tokenization import load_tokenizer
    from trainer.export import save_model_dir

    first, _ = _two_tokenizers()
    save_model_dir(_tiny_model(), first, tmp_path)
    (tmp_path / "tokenizer_files.json").unlink()  # written before the marker, or by another program
    assert _described(load_tokenizer(tmp_path)) == _described(first)


@pytest.mark.parametrize("content, problem", [
    (b"{", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (b"", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    (b"\xff{}", "not valid UTF-8 (byte 0xff at offset 0)"),
    (b'["tokenizer.json"]', f"{SHAPE}: it holds a list"),
    (b"null", f"{SHAPE}: it holds null"),
    (b'{"writing": true}', f'{SHAPE}: it has no "files"'),
    (b'{"files": "tokenizer.json"}', f'{SHAPE}: its "files" is "tokenizer.json"'),
    (b'{"files": ["tokenizer.json", 5]}', f'{SHAPE}: its "files" hold 5'),
    (b'{"files": [], "writing": false}', f'{SHAPE}: its "writing" is false'),
    (b'{"files": [], "writing": null}', f'{SHAPE}: its "writing" is null'),
    (b'{"files": [], "complete": true}', f'{SHAPE}: it holds the keys "files", "complete"'),
    # a value or key quoted as every refusal quotes one (dataset/shown_value.py: one line, the quote mark and 56
    # more of its 60 characters, then "..."), not by a cut of its own
    (b'{"files": [], "writing": "\\n' + b"x" * 10_000 + b'"}', f'{SHAPE}: its "writing" is "\\n{"x" * 54}...'),
    (b'{"files": [], "' + b"k" * 10_000 + b'\\n": 1}', f'{SHAPE}: it holds the keys "files", "{"k" * 56}...'),
])
def test_a_tokenizer_marker_that_is_not_what_a_save_writes_is_refused_in_one_line(content, problem, tmp_path):
    """A tokenizer_files.json cut short, edited by hand or of another program's: before, it loaded unchecked, as if
    no marker were there, though a stopped save's files may be beside it. The one line names the file and the ways
    on; once a save writes it again the folder loads."""
    from dataset.tokenization import check_tokenizer_files, load_tokenizer
    from trainer.export import save_model_dir

    first, _ = _two_tokenizers()
    save_model_dir(_tiny_model(), first, tmp_path)
    (tmp_path / "tokenizer_files.json").write_bytes(content)
    for load in (check_tokenizer_files, load_tokenizer):
        with pytest.raises(ValueError) as refused:
            load(tmp_path)
        assert str(refused.value) == (f"{tmp_path / 'tokenizer_files.json'}: {problem}, so whether a save of "
                                      f"{tmp_path} stopped midway cannot be told: save the model directory again, "
                                      f"or delete that file to load the tokenizer files unchecked")
    save_model_dir(_tiny_model(), first, tmp_path)
    assert _described(load_tokenizer(tmp_path)) == _described(first)


# save_model_dir of a tiny model and MiniNorm's tokenizer (argv: the repository, the folder, "second" for a tokenizer
# with another chat template, "killed" to end the process once its files are staged, before any is moved in).
SAVE_IN_ANOTHER_PROCESS = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import trainer.export as export
from dataset.tokenization import load_tokenizer
from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM
tokenizer = load_tokenizer(None)
if "second" in sys.argv:
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    tokenizer.model_max_length = 77
if "killed" in sys.argv:
    export.begin_tokenizer_save = lambda *args: os._exit(9)
model = MiniNormForCausalLM(MiniNormConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=2))
export.save_model_dir(model, tokenizer, Path(sys.argv[2]))
"""


def _save_in_another_process(folder, *how: str) -> int:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", SAVE_IN_ANOTHER_PROCESS, str(REPO), str(folder), *how],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 9), run.stderr[-3000:]
    return run.returncode


def _staging_folders(folder) -> list[str]:
    return sorted(item.name for item in folder.iterdir() if item.name.startswith(".model_"))


def test_a_save_removes_the_staging_folders_a_killed_save_left(tmp_path):
    """save_model_dir stages the whole model in a `.model_*` folder inside the out dir; a save killed before its
    cleanup left that folder (a copy of the weights) behind for good. The next save removes such folders whose
    writer is gone (the killed process; a save from before the pid and host were recorded), and only those: a live
    process's, another machine's (it cannot be asked) and a folder of the user's that merely starts the same way
    are kept."""
    import os
    import socket

    import trainer.export as export

    assert _save_in_another_process(tmp_path, "killed") == 9
    left = _staging_folders(tmp_path)
    assert len(left) == 1 and (tmp_path / left[0] / "model.safetensors").is_file(), left
    assert left[0].endswith(f"@{socket.gethostname()}") and not (tmp_path / "model.safetensors").exists()
    dead = left[0].rsplit(".", 1)[1].split("@")[0]  # the killed writer's pid: gone here, unknown on another machine
    kept = [f".model_abcdefgh.{os.getppid()}@{socket.gethostname()}", ".model_abcdefgh.1@another-machine",
            f".model_abcdefgi.{dead}@another-machine",
            ".model_notes"]  # the last: not a staging folder's name (8 characters after the prefix)
    for name in [*kept, ".model_12345678"]:  # the last: a save's from before
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("x")
    first, _ = _two_tokenizers()
    export.save_model_dir(_tiny_model(), first, tmp_path)
    assert _staging_folders(tmp_path) == sorted(kept)
    assert all((tmp_path / name / "mine.txt").read_text() == "x" for name in kept)


def test_a_staging_folder_of_another_users_live_process_is_kept(monkeypatch):
    """A writer whose existence the signal-0 probe may not ask about (PermissionError: another user's process) is
    taken as live, so its folder is kept (a mutant that took it as gone survived: these tests run as root)."""
    import os
    import socket

    import trainer.export as export

    def not_yours(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", not_yours)
    assert export._writer_gone("4242", socket.gethostname()) is False
    assert export._writer_gone(None, None) is True  # a save from before the names held a pid and host


def test_two_saves_at_once_into_one_directory_keep_each_others_staging_folder(tmp_path, monkeypatch):
    """Save A has staged its files when save B, another process, saves into the same directory from start to end:
    B took A's staging folder for a killed save's leftover and removed it, and A failed moving its files in
    (FileNotFoundError). Now B keeps it (A's process lives) and A completes: the directory loads as A's save."""
    import trainer.export as export
    from dataset.tokenization import load_tokenizer

    first, second = _two_tokenizers()
    give_open_modes = export.give_open_modes  # called once A's files are staged, before it holds the folder
    seen = []

    def save_b_meanwhile(staging):
        give_open_modes(staging)
        folder = staging.parent
        staged = _staging_folders(folder)
        assert _save_in_another_process(folder, "second") == 0
        assert _described(load_tokenizer(folder)) == _described(second)  # B's save, whole
        seen.append((staged, _staging_folders(folder)))

    monkeypatch.setattr(export, "give_open_modes", save_b_meanwhile)
    export.save_model_dir(_tiny_model(), first, tmp_path)
    [(staged, after_b)] = seen
    assert len(staged) == 1 and after_b == staged  # A's, still there once B was done
    assert _staging_folders(tmp_path) == []
    assert _described(load_tokenizer(tmp_path)) == _described(first)


# A save into a folder (argv: the repository, "model" for save_model_dir or "tokenizer" for train_tokenizer.py's save,
# the folder, a folder for event files, then "held": once it holds the folder, it writes EVENTS/holding and waits for
# EVENTS/release before moving its files in).
SAVE_AT_ONCE = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
what, folder, events = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
from dataset.tokenization import load_tokenizer
tokenizer = load_tokenizer(None)
def held(begin):
    def hold_then_begin(*args):
        (events / "holding").write_text("")
        while not (events / "release").exists():
            time.sleep(0.02)
        begin(*args)
    return hold_then_begin
if what == "model":
    import trainer.export as export
    from model.config import MiniNormConfig
    from model.model import MiniNormForCausalLM
    if "held" in sys.argv:
        export.begin_tokenizer_save = held(export.begin_tokenizer_save)
    model = MiniNormForCausalLM(MiniNormConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2))
    export.save_model_dir(model, tokenizer, folder)
else:
    import scripts.train_tokenizer as script
    if "held" in sys.argv:
        script.begin_tokenizer_save = held(script.begin_tokenizer_save)
    script.save(tokenizer, folder)
"""


def _start_save(what: str, folder, events, *how: str):
    import subprocess
    import sys

    events.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", SAVE_AT_ONCE, str(REPO), what, str(folder), str(events), *how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(event, process) -> None:
    """Until the file `event` exists; fails if `process` ends first (a bound on the wait, not on its time)."""
    import time

    deadline = time.monotonic() + 300
    while not event.exists():
        if process.poll() is not None:
            err = process.communicate()[1]
            raise AssertionError(f"ended ({process.returncode}) before {event.name}: {err[-3000:]}")
        assert time.monotonic() < deadline, f"no {event.name} in 300 s"
        time.sleep(0.02)


def _ended(process) -> int:
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return process.returncode


@pytest.mark.parametrize("holder", ["model", "tokenizer"])
def test_a_save_into_a_folder_another_process_is_saving_into_is_refused_naming_it(holder, tmp_path, monkeypatch):
    """Two saves into one folder at once (two runs given the same --out_dir, or train_tokenizer.py beside a model's
    save) moved their files in interleaved and left a mix of both. A save moving its files in holds the folder:
    another save, past its wait, is refused in one line naming the folder and the holder's pid and host, and
    changes nothing; the holder's save completes whole and leaves no lock file."""
    import socket

    import dataset.tokenization as tokenization
    import scripts.train_tokenizer as script
    import trainer.export as export
    from dataset.tokenization import load_tokenizer

    first, second = _two_tokenizers()
    folder, events = tmp_path / "model", tmp_path / "events"
    holding = _start_save(holder, folder, events, "held")
    _wait_for(events / "holding", holding)
    monkeypatch.setattr(tokenization, "SAVE_LOCK_WAIT_S", 0.0)
    before = {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
    try:
        for save in (lambda: export.save_model_dir(_tiny_model(), second, folder),
                     lambda: script.save(second, folder)):
            with pytest.raises(ValueError) as refused:
                save()
            assert str(refused.value) == (f"{folder}: another save into it is under way (pid {holding.pid} on host "
                                          f"{socket.gethostname()}; lock file {folder / '.save.lock'}), still after "
                                          f"0 s: let it end, then try again, or use another folder")
            assert {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()} == before
    finally:
        (events / "release").write_text("")  # a failed check must not leave the holder polling
    _ended(holding)
    assert _described(load_tokenizer(folder)) == _described(first)
    assert not (folder / ".save.lock").exists() and _staging_folders(folder) == []


@pytest.mark.parametrize("holder, waiter", [("model", "model"), ("tokenizer", "model"), ("model", "tokenizer")])
def test_a_save_waits_for_the_save_holding_the_folder_then_saves_whole(holder, waiter, tmp_path, monkeypatch):
    """Within its wait (a minute by default), a second save waits for the one holding the folder (another process)
    and then moves its own files in: the folder is the second save's whole, not a mix."""
    import time
    import types

    import dataset.atomic_io as atomic_io
    import scripts.train_tokenizer as script
    import trainer.export as export
    from dataset.tokenization import load_tokenizer

    _, second = _two_tokenizers()
    folder, events = tmp_path / "model", tmp_path / "events"
    holding = _start_save(holder, folder, events, "held")
    _wait_for(events / "holding", holding)
    waits = []

    def release_then_sleep(seconds: float) -> None:  # the waiting save's poll: the holder is let go at its first
        if not waits:
            (events / "release").write_text("")
        waits.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(atomic_io, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=release_then_sleep))
    try:
        if waiter == "model":
            export.save_model_dir(_tiny_model(), second, folder)
        else:
            script.save(second, folder)
    finally:
        (events / "release").write_text("")  # a save that did not wait must not leave the holder polling
    _ended(holding)
    assert waits  # it did wait for the holder
    assert _described(load_tokenizer(folder)) == _described(second)
    assert json.loads((folder / "tokenizer_files.json").read_text()).get("writing") is None
    assert not (folder / ".save.lock").exists()


def test_a_killed_saves_hold_on_the_folder_is_taken_over(tmp_path, monkeypatch):
    """A save killed while it held the folder leaves its lock file, naming its pid; the kernel released its lock
    with the process, so the next save takes the folder at once (no wait) and saves whole."""
    import signal

    import dataset.tokenization as tokenization
    import trainer.export as export
    from dataset.tokenization import load_tokenizer

    _, second = _two_tokenizers()
    folder, events = tmp_path / "model", tmp_path / "events"
    killed = _start_save("model", folder, events, "held")
    _wait_for(events / "holding", killed)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=300)
    assert (folder / ".save.lock").read_text().startswith(f"{killed.pid}@")
    monkeypatch.setattr(tokenization, "SAVE_LOCK_WAIT_S", 0.0)
    export.save_model_dir(_tiny_model(), second, folder)
    assert _described(load_tokenizer(folder)) == _described(second)
    assert not (folder / ".save.lock").exists()


def test_a_save_after_a_stopped_one_removes_the_stopped_saves_files_it_does_not_write(tmp_path, monkeypatch):
    """A save stopped while it moved its files in (a chat_template.jinja among them) and the next save, of a tokenizer
    without a template, completing: the stopped save's marker said only that a save was under way, not which files
    it may have left, so the complete save kept the stopped one's chat_template.jinja and the folder loaded as the
    new tokenizer with the old template, without a word."""
    import trainer.export as export
    from dataset.tokenization import load_tokenizer

    _, templated = _two_tokenizers()
    plain, _ = _two_tokenizers()
    plain.chat_template = None
    model = _tiny_model()
    for stop_after in range(8):
        folder = tmp_path / f"stop_{stop_after}"
        export.save_model_dir(model, plain, folder)
        moved = _save_stopped_after(stop_after, model, templated, folder, monkeypatch)
        export.save_model_dir(model, plain, folder)
        assert not (folder / "chat_template.jinja").exists(), (stop_after, moved)
        assert _described(load_tokenizer(folder)) == _described(plain), (stop_after, moved)


def test_the_tokenizer_marker_by_hand(tmp_path):
    """begin_tokenizer_save marks the save under way and removes only the earlier save's files inside the folder
    that this one does not write (a hand-edited marker naming ../, a file already gone or a non-name is passed
    over, a marker that is not JSON is written over); end_tokenizer_save records the names sorted; load_tokenizer
    refuses a folder marked as being written before it reads any file."""
    from dataset.tokenization import (begin_tokenizer_save, check_tokenizer_files, end_tokenizer_save,
                                      load_tokenizer)

    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside.txt").write_text("not the save's")
    for name in ("chat_template.jinja", "tokenizer.json"):
        (folder / name).write_text("{}")
    (folder / "tokenizer_files.json").write_text(json.dumps(
        {"files": ["../outside.txt", "gone.json", 5, "chat_template.jinja", "tokenizer.json"]}))
    begin_tokenizer_save(folder, ["tokenizer.json"])
    assert (tmp_path / "outside.txt").is_file() and (folder / "tokenizer.json").is_file()
    assert not (folder / "chat_template.jinja").exists()
    # while writing, the marker lists what may be in the folder should this save stop: the earlier names, this one's
    assert json.loads((folder / "tokenizer_files.json").read_text()) == {
        "writing": True, "files": ["chat_template.jinja", "gone.json", "tokenizer.json"]}
    for load in (check_tokenizer_files, load_tokenizer):
        with pytest.raises(ValueError) as refused:
            load(folder)
        assert str(refused.value).startswith(f"{folder / 'tokenizer_files.json'}: a save of {folder} stopped")
    end_tokenizer_save(folder, ["tokenizer_config.json", "tokenizer.json"])
    assert json.loads((folder / "tokenizer_files.json").read_text()) == {
        "files": ["tokenizer.json", "tokenizer_config.json"]}
    check_tokenizer_files(folder)
    (folder / "tokenizer_files.json").write_text("{")
    begin_tokenizer_save(folder, ["tokenizer.json"])
    assert json.loads((folder / "tokenizer_files.json").read_text()) == {"writing": True, "files": ["tokenizer.json"]}


@pytest.mark.parametrize("text", ["", "hello world", "x" * 300, " " * 100, "é中😀 " * 40, "<|im_end|>" * 5,
                                  "1234567890" * 30, "\n\n\t  a" * 20])
def test_a_texts_token_range_holds_its_tokens(tokenizer, text):
    """text_token_range bounds what encode_text takes without tokenizing (chat refuses a message by its length
    alone): a MiniNorm token covers 1 to 16 bytes."""
    from dataset.chat_format import encode_text
    from dataset.tokenization import longest_token_bytes, text_token_range

    fewest, most = text_token_range(tokenizer, text)
    assert longest_token_bytes(tokenizer) == 16 and fewest <= len(encode_text(tokenizer, text)) <= most


def test_a_tokenizer_that_is_not_byte_level_bpe_gets_no_token_range(sentencepiece_tokenizer):
    from dataset.tokenization import text_token_range

    assert text_token_range(sentencepiece_tokenizer, "hello") is None
