"""scripts/convert_to_gguf.py: the GGUF file, read back with the `gguf` reader, holds exactly the model directory's
tensors (the safetensors file, read on its own) and its tokenizer, under llama.cpp's LLaMA names and metadata."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import regex
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import load_file

from scripts.convert_to_gguf import convert_to_gguf, main, tensor_type
from scripts.convert_to_llama import convert_to_llama

OUT_TYPES = ("f32", "f16", "bf16", "q8_0")
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama.cpp's LLAMA_FTYPE_* numbers
# GPT-2's split pattern, which llama.cpp's "gpt-2" pre-tokenizer applies.
GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
TEXTS = ("Hello world! It's 2026, isn't it?", "北京是中华人民共和国的首都。", "emoji 🙂👍🏽 and  two  spaces\n\nnew",
         "numbers 3.14159 1234567 -42", "<|im_start|>user\nHi<|im_end|>\n")


@pytest.fixture(scope="module")
def gguf_files(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {outtype: convert_to_gguf(tiny_models.pretrain, root / f"tiny-{outtype}.gguf", outtype)
            for outtype in OUT_TYPES}


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def _expected_tensors(model_dir, config) -> dict[str, np.ndarray]:
    """The GGUF name and float32 value of every weight, from model.safetensors and llama.cpp's conventions as
    written out here: its tensor names, and RoPE on adjacent pairs (so within each head, row i of the first half
    goes to row 2i and row i of the second half to row 2i + 1)."""
    weights = load_file(str(model_dir / "model.safetensors"))
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "attn_norm": "attn_norm", "mlp_norm": "ffn_norm"}
    expected = {"token_embd.weight": weights.pop("model.embed_tokens.weight"),
                "output_norm.weight": weights.pop("model.norm.weight")}
    if "lm_head.weight" in weights:  # tied: the same matrix, which llama.cpp takes from token_embd
        np.testing.assert_array_equal(weights.pop("lm_head.weight"), expected["token_embd.weight"])
    for key, value in weights.items():
        _, _, layer, rest = key.split(".", 3)
        module = rest.removesuffix(".weight")
        if module.split(".")[-1] in heads:
            n_heads = heads[module.split(".")[-1]]
            head_dim = value.shape[0] // n_heads
            order = [h * head_dim + half * head_dim // 2 + i
                     for h in range(n_heads) for i in range(head_dim // 2) for half in (0, 1)]
            value = value[order]
        expected[f"blk.{layer}.{names[module]}.weight"] = value
    return {name: value.astype(np.float32) for name, value in expected.items()}


@pytest.mark.parametrize("outtype", OUT_TYPES)
def test_every_tensor_equals_the_safetensors(tiny_models, gguf_files, outtype) -> None:
    config = json.loads((tiny_models.pretrain / "config.json").read_text())
    expected = _expected_tensors(tiny_models.pretrain, config)
    reader = GGUFReader(gguf_files[outtype])
    assert sorted(t.name for t in reader.tensors) == sorted(expected)  # no output.weight: the head is tied
    assert _field(reader, "general.file_type") == FILE_TYPES[outtype]
    for tensor in reader.tensors:
        want = expected[tensor.name]
        assert list(tensor.shape) == list(want.shape[::-1])  # GGML lists dimensions fastest first
        if want.ndim == 1 or outtype == "f32":  # norms are always f32; everything is exact
            assert tensor.tensor_type == GGMLQuantizationType.F32
            np.testing.assert_array_equal(tensor.data, want, err_msg=tensor.name)
        elif outtype == "f16":
            assert tensor.tensor_type == GGMLQuantizationType.F16
            np.testing.assert_array_equal(tensor.data, want.astype(np.float16), err_msg=tensor.name)
        elif outtype == "bf16":  # round to nearest even, as torch rounds
            assert tensor.tensor_type == GGMLQuantizationType.BF16
            bits = torch.from_numpy(want).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            np.testing.assert_array_equal(tensor.data.view(np.uint16), bits, err_msg=tensor.name)
        else:  # q8_0: blocks of 32 int8 values times one scale, max |x| / 127 stored as f16, so each value is
            # within half a step, plus up to 127 times the scale's f16 rounding (2^-11 relative): < 0.6 steps
            assert tensor.tensor_type == GGMLQuantizationType.Q8_0
            got = dequantize(tensor.data, tensor.tensor_type).reshape(want.shape)
            step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            assert (np.abs(got - want).reshape(-1, 32) <= step * 0.6).all(), tensor.name
            assert np.abs(got - want).max() > 0  # really quantized


def test_llama_metadata_equals_the_config(tiny_models, gguf_files) -> None:
    config = json.loads((tiny_models.pretrain / "config.json").read_text())
    reader = GGUFReader(gguf_files["f32"])
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    expected = {
        "general.architecture": "llama", "llama.vocab_size": config["vocab_size"],
        "llama.context_length": config["max_position_embeddings"],
        "llama.embedding_length": config["hidden_size"], "llama.block_count": config["num_hidden_layers"],
        "llama.feed_forward_length": config["intermediate_size"],
        "llama.attention.head_count": config["num_attention_heads"],
        "llama.attention.head_count_kv": config["num_key_value_heads"],
        "llama.attention.key_length": head_dim, "llama.attention.value_length": head_dim,
        "llama.rope.dimension_count": head_dim,
        "llama.rope.freq_base": np.float32(config["rope_theta"]),
        "llama.attention.layer_norm_rms_epsilon": np.float32(config["norm_eps"]),
    }
    assert {key: _field(reader, key) for key in expected} == expected


def test_tokenizer_metadata_equals_the_tokenizer_files(tiny_models, gguf_files) -> None:
    model_dir = tiny_models.pretrain
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    template_file = model_dir / "chat_template.jinja"
    template = (template_file.read_text(encoding="utf-8") if template_file.is_file() else
                json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"])
    reader = GGUFReader(gguf_files["f16"])

    vocab = dict(tokenizer_json["model"]["vocab"])
    specials = {token["content"]: token["id"] for token in tokenizer_json["added_tokens"] if token["special"]}
    vocab.update(specials)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert tokens == [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    types = _field(reader, "tokenizer.ggml.token_type")
    assert [i for i, kind in enumerate(types) if kind == 3] == sorted(specials.values())  # CONTROL
    assert set(types) == {1, 3}  # the rest NORMAL
    merges = tokenizer_json["model"]["merges"]
    assert not any(" " in part for pair in merges for part in pair)  # else GGUF would need to escape them
    assert _field(reader, "tokenizer.ggml.merges") == [" ".join(pair) for pair in merges]

    assert _field(reader, "tokenizer.ggml.model") == "gpt2" and _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    im_end = specials["<|im_end|>"]
    assert _field(reader, "tokenizer.ggml.eos_token_id") == im_end == 2
    assert _field(reader, "tokenizer.ggml.bos_token_id") == im_end  # named, never added:
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert _field(reader, "tokenizer.ggml.add_eos_token") is False
    assert _field(reader, "tokenizer.ggml.padding_token_id") == specials["<|endoftext|>"]
    assert _field(reader, "tokenizer.chat_template") == template


def test_our_split_is_gpt2s(tokenizer) -> None:
    """Why "gpt-2" is the right pre-tokenizer for llama.cpp: our tokenizer cuts text where GPT-2's pattern does,
    with no prefix space (tests/integration/test_llama_cpp.py then checks llama.cpp's token ids themselves)."""
    pre_tokenizer = tokenizer.backend_tokenizer.pre_tokenizer
    for text in TEXTS:
        pieces = [text[start:end] for _, (start, end) in pre_tokenizer.pre_tokenize_str(text)]
        assert pieces == GPT2_SPLIT.findall(text), text


def test_a_llama_export_gives_the_same_tensors(tiny_models, gguf_files, tmp_path) -> None:
    llama_dir = convert_to_llama(tiny_models.pretrain, tmp_path / "llama")
    from_export = GGUFReader(convert_to_gguf(llama_dir, tmp_path / "from-llama.gguf", "f16"))
    from_ours = GGUFReader(gguf_files["f16"])
    names_and_types = [[(t.name, t.tensor_type) for t in reader.tensors] for reader in (from_export, from_ours)]
    assert names_and_types[0] == names_and_types[1]
    for ours, theirs in zip(from_ours.tensors, from_export.tensors):
        assert ours.data.tobytes() == theirs.data.tobytes(), ours.name
    assert _field(from_export, "tokenizer.ggml.tokens") == _field(from_ours, "tokenizer.ggml.tokens")


def test_q8_0_falls_back_to_f16_for_rows_that_are_not_whole_blocks() -> None:
    import gguf

    assert tensor_type(gguf, (64, 96), "q8_0") == GGMLQuantizationType.Q8_0
    assert tensor_type(gguf, (64, 48), "q8_0") == GGMLQuantizationType.F16
    assert tensor_type(gguf, (64,), "q8_0") == GGMLQuantizationType.F32


def _refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    return error


def test_post_ln_model_is_refused_like_the_llama_export(tiny_models, tmp_path, capsys) -> None:
    out = tmp_path / "post.gguf"
    error = _refused(capsys, "--model_path", str(tiny_models.post_ln), "--outfile", str(out))
    assert error.startswith(f"error: cannot convert {tiny_models.post_ln} to GGUF: norm_placement='post'")
    assert "pre-LN" in error and not out.exists() and list(tmp_path.iterdir()) == []


def test_a_file_that_is_not_gguf_is_not_replaced(tiny_models, tmp_path, capsys) -> None:
    out = tmp_path / "notes.gguf"
    out.write_text("keep me")
    error = _refused(capsys, "--model_path", str(tiny_models.pretrain), "--outfile", str(out))
    assert "is not a GGUF file" in error and out.read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.gguf"]


def test_an_earlier_gguf_is_replaced(tiny_models, gguf_files, tmp_path, capsys) -> None:
    out = tmp_path / "model.gguf"
    out.write_bytes(gguf_files["f32"].read_bytes())
    assert main(["--model_path", str(tiny_models.pretrain), "--outfile", str(out), "--outtype", "q8_0"]) == 0
    assert _field(GGUFReader(out), "general.file_type") == FILE_TYPES["q8_0"]
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]  # no temp file left
    assert "wrote" in capsys.readouterr().out


def test_missing_gguf_package_is_a_one_line_install_hint(tiny_models, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    error = _refused(capsys, "--model_path", str(tiny_models.pretrain), "--outfile", str(tmp_path / "x.gguf"))
    assert "pip install" in error and "gguf" in error


def _copied_model(tiny_models, folder):
    shutil.copytree(tiny_models.pretrain, folder)
    return folder


def _edit_tokenizer(**fields):
    def edit(folder) -> None:
        spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        (folder / "tokenizer.json").write_text(json.dumps({**spec, **fields}), encoding="utf-8")
    return edit


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# (what differs from GPT-2's byte-level split, the tokenizer.json edit, what the refusal names)
FOREIGN_TOKENIZERS = [
    ("qwen2_split", _edit_tokenizer(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}),
     "pre_tokenizer {'type': 'Sequence'"),
    ("prefix_space", _edit_tokenizer(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True,
                                                    "trim_offsets": True, "use_regex": True}),
     "pre_tokenizer {'type': 'ByteLevel', 'add_prefix_space': True"),
    ("nfc_normalizer", _edit_tokenizer(normalizer={"type": "NFC"}), "normalizer {'type': 'NFC'}"),
]


@pytest.mark.parametrize(("edit", "named"), [case[1:] for case in FOREIGN_TOKENIZERS],
                         ids=[case[0] for case in FOREIGN_TOKENIZERS])
def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused(tiny_models, tmp_path, capsys, edit, named) -> None:
    """The GGUF says pre='gpt-2': only a tokenizer that cuts text exactly as GPT-2's split does may be written so
    (an imported checkpoint keeps its own pre-tokenizer)."""
    model = _copied_model(tiny_models, tmp_path / "model")
    edit(model)
    error = _refused(capsys, "--model_path", str(model), "--outfile", str(tmp_path / "x.gguf"))
    assert f"cannot convert {model} to GGUF: tokenizer.json's" in error and named in error, error
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize(("file", "field", "named"), [
    # the list's repr cut at 57 characters ("['x', " then 5 per item) and "..." added
    ("tokenizer.json", "model", "tokenizer.json's model ['x', " + "'x', " * 10 + "'... is not the byte-level BPE"),
    ("tokenizer.json", "pre_tokenizer", "tokenizer.json's pre_tokenizer ['x', " + "'x', " * 10 + "'... is not GPT-2's"),
    ("tokenizer.json", "normalizer", "tokenizer.json's normalizer ['x', " + "'x', " * 10 + "'... is not supported"),
    ("config.json", "model_type", "is not a MiniNorm model or a Llama export (model_type=['x', " + "'x', " * 10
     + "'...)"),
])
def test_a_long_list_where_a_name_belongs_is_quoted_in_one_short_line(tiny_models, tmp_path, capsys, file, field,
                                                                       named) -> None:
    """A refused value is quoted as every refusal quotes one (dataset/shown_value.py): a list of 500 items in
    tokenizer.json's "model" or config.json's "model_type" was printed whole, and its "pre_tokenizer" or
    "normalizer" as JSON cut at 100 characters by a rule of its own."""
    model = _copied_model(tiny_models, tmp_path / "model")
    spec = json.loads((model / file).read_text(encoding="utf-8"))
    (model / file).write_text(json.dumps({**spec, field: ["x"] * 500}), encoding="utf-8")
    error = _refused(capsys, "--model_path", str(model), "--outfile", str(tmp_path / "x.gguf"))
    assert named in error and "'x', " * 12 not in error, error


def test_a_gguf_from_elsewhere_is_not_replaced(tiny_models, tmp_path, capsys) -> None:
    import gguf

    out = tmp_path / "downloaded.gguf"
    writer = gguf.GGUFWriter(out, arch="llama")
    writer.add_name("someone else's model")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    before = out.read_bytes()
    error = _refused(capsys, "--model_path", str(tiny_models.pretrain), "--outfile", str(out))
    assert "this tool did not write" in error and "mininorm.source" in error and out.read_bytes() == before


def test_the_file_records_its_source(tiny_models, gguf_files, tmp_path, monkeypatch) -> None:
    # outside the repo: the directory's name; inside: its path from the repo root; never this machine's path
    assert _field(GGUFReader(gguf_files["f16"]), "mininorm.source") == tiny_models.pretrain.name
    monkeypatch.setattr("trainer.run_dir.REPO_ROOT", tmp_path)
    inside = shutil.copytree(tiny_models.pretrain, tmp_path / "out" / "runs" / "pretrain")
    out = convert_to_gguf(inside, tmp_path / "inside.gguf", "f32")
    assert _field(GGUFReader(out), "mininorm.source") == "out/runs/pretrain"


def test_the_same_model_in_two_places_gives_the_same_bytes(tiny_models, tmp_path) -> None:
    # two clones, two users: the file must not depend on where the model directory lies
    near = shutil.copytree(tiny_models.pretrain, tmp_path / "a" / "pretrain")
    far = shutil.copytree(tiny_models.pretrain, tmp_path / "somewhere" / "much" / "deeper" / "pretrain")
    first = convert_to_gguf(near, tmp_path / "near.gguf", "f16").read_bytes()
    second = convert_to_gguf(far, tmp_path / "far.gguf", "f16").read_bytes()
    assert len(first) == len(second) and first == second


# (what is wrong, the edit of a copy of the tiny model, what the one-line refusal names)
BAD_MODELS = [
    ("missing_tensor", "missing model.norm.weight"),
    ("truncated", "model.safetensors is not a readable safetensors file"),
    ("outfile_under_a_file", "is a file, not a folder"),
]


@pytest.mark.parametrize(("case", "named"), BAD_MODELS, ids=[case[0] for case in BAD_MODELS])
def test_bad_input_is_one_line(tiny_models, tmp_path, capsys, case, named) -> None:
    from safetensors.torch import load_file as load_torch, save_file

    model = _copied_model(tiny_models, tmp_path / "model")
    weights = model / "model.safetensors"
    out = tmp_path / "x.gguf"
    if case == "missing_tensor":
        tensors = load_torch(weights)
        del tensors["model.norm.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
    elif case == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        out = model / "config.json" / "x.gguf"
    error = _refused(capsys, "--model_path", str(model), "--outfile", str(out))
    assert named in error and str(model) in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
