"""scripts/convert_to_llama.py: the exported directory is a stock LlamaForCausalLM with our logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from model.loading import load_model
from model.model import MiniNormForCausalLM
from model.export_dir import EXPORT_MARKER, check_out_dir
from dataset.atomic_io import path_overlap
from trainer.run_dir import model_task
from scripts.convert_to_llama import convert_to_llama, main
from tests.checkpoint_shards import two_shards
from tests.generation_configs import ACCEPTED_GENERATION_CONFIGS


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    return convert_to_llama(tiny_models.pretrain, tmp_path_factory.mktemp("export") / "llama")


def test_exported_llama_logits_equal_ours(tiny_models, exported) -> None:
    ours, _ = load_model(tiny_models.pretrain)
    llama = AutoModelForCausalLM.from_pretrained(exported)
    assert type(llama) is LlamaForCausalLM
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)
    # Tied embeddings stay tied, and the norm gains (perturbed away from 1 in the fixture) arrived.
    assert llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(llama.model.layers[1].post_attention_layernorm.weight,
                               ours.model.layers[1].mlp_norm.weight, atol=0, rtol=0)


def test_exported_directory_is_complete(tiny_models, exported, tokenizer) -> None:
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 1e6  # for pre-rope_parameters readers
    assert GenerationConfig.from_pretrained(exported).eos_token_id == tokenizer.eos_token_id == 2
    theirs = AutoTokenizer.from_pretrained(exported)
    messages = [{"role": "user", "content": "Hi 你好"}]
    ours_rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert theirs.apply_chat_template(messages, tokenize=False) == ours_rendered
    assert theirs("The history of 北京")["input_ids"] == tokenizer("The history of 北京")["input_ids"]
    assert not [p.name for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temp dir left
    assert model_task(exported) == "pretrain"  # train_config.yaml came along, for eval/chat.py


def test_export_replaces_a_previous_one(tiny_models, tmp_path, capsys) -> None:
    out = convert_to_llama(tiny_models.pretrain, tmp_path / "llama", verify=False)
    assert json.loads((out / "exported_from.json").read_text())["target"] == "llama"  # the marker it is known by
    (out / "stale.txt").write_text("old")
    assert main(["--model_path", str(tiny_models.pretrain), "--out_dir", str(out), "--no_verify"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]
    # it says what it replaced: the default --out_dir is every model's, and another model's export went in silence
    said = capsys.readouterr().out.strip()
    assert said.endswith(f"; it replaced the earlier export there, of {tiny_models.pretrain}")
    assert main(["--model_path", str(tiny_models.pretrain), "--out_dir", str(tmp_path / "new"), "--no_verify"]) == 0
    assert "replaced" not in capsys.readouterr().out


def test_a_llama_checkpoint_from_elsewhere_is_not_replaced(tiny_models, exported, tmp_path, capsys) -> None:
    """A real transformers Llama directory (here: an export without our marker, plus a model card and notes) has
    the config.json of an export; its files are not ours to delete."""
    foreign = tmp_path / "downloaded"
    shutil.copytree(exported, foreign)
    (foreign / "exported_from.json").unlink()
    (foreign / "README.md").write_text("model card")
    (foreign / "training_logs.txt").write_text("irreplaceable")
    files = sorted(p.name for p in foreign.iterdir())
    error = _refused(capsys, "--model_path", str(tiny_models.pretrain), "--out_dir", str(foreign))
    assert str(foreign) in error and "exported_from.json" in error
    assert sorted(p.name for p in foreign.iterdir()) == files and (foreign / "README.md").read_text() == "model card"


def test_export_fills_an_empty_folder(tiny_models, tmp_path) -> None:
    (tmp_path / "llama").mkdir()
    assert main(["--model_path", str(tiny_models.pretrain), "--out_dir", str(tmp_path / "llama"), "--no_verify"]) == 0
    assert (tmp_path / "llama" / "model.safetensors").is_file()


def test_saved_config_names_the_class_and_the_weights_dtype(exported) -> None:
    # save_pretrained writes both, so the converter does not patch them.
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"


def _copied_model(tiny_models, folder):
    """A private copy of the tiny pretrained model: a broken refusal must not delete the shared fixture."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_models.pretrain, folder)
    return folder, sorted(p.name for p in folder.iterdir())


def _refused(capsys, *argv: str) -> str:
    assert main([*argv, "--no_verify"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    return error


def test_parent_of_the_model_is_refused_and_left_alone(tiny_models, tmp_path, capsys) -> None:
    model, files = _copied_model(tiny_models, tmp_path / "out" / "pretrain")
    error = _refused(capsys, "--model_path", str(model), "--out_dir", str(tmp_path / "out"))
    assert "overlaps the model" in error
    assert sorted(p.name for p in model.iterdir()) == files
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["pretrain"]


@pytest.mark.parametrize("out_dir", ["out/x/../pretrain", "out/pretrain/llama"])
def test_the_model_itself_or_a_folder_inside_it_is_refused(tiny_models, tmp_path, capsys, out_dir) -> None:
    model, files = _copied_model(tiny_models, tmp_path / "out" / "pretrain")
    error = _refused(capsys, "--model_path", str(model), "--out_dir", str(tmp_path / out_dir))
    assert "overlaps the model" in error
    assert sorted(p.name for p in model.iterdir()) == files


@pytest.mark.parametrize("spelling", ["symlink", "relative"])
def test_the_out_dir_check_resolves_the_paths_itself(tmp_path, monkeypatch, spelling) -> None:
    """model.export_dir.check_out_dir compares the paths as the trainers' --out_dir check does (path_overlap): it
    compared them as given, so a link to the model, or a relative spelling of it, holding the marker passed and the
    model would have been replaced."""
    model = tmp_path / "model"
    model.mkdir()
    (model / EXPORT_MARKER).write_text('{"target": "llama"}')
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(tmp_path)
    out_dir = {"symlink": tmp_path / "link", "relative": Path("model")}[spelling]
    with pytest.raises(ValueError, match="overlaps the model"):
        check_out_dir(model, out_dir, EXPORT_MARKER, "a previous Llama export", {"target": "llama"})
    assert path_overlap(out_dir, model) == "is" and path_overlap(model / "sub", out_dir) == "is inside"
    assert path_overlap(tmp_path, out_dir) == "holds" and path_overlap(tmp_path / "other", out_dir) is None


def test_a_folder_that_is_not_an_export_is_refused_and_left_alone(tiny_models, tmp_path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    error = _refused(capsys, "--model_path", str(tiny_models.pretrain), "--out_dir", str(out))
    assert str(out) in error and "neither empty nor a previous Llama export" in error
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging folder left


def test_an_export_is_not_converted_again(exported, tmp_path, capsys) -> None:
    error = _refused(capsys, "--model_path", str(exported), "--out_dir", str(tmp_path / "again"))
    assert "is not a MiniNorm model (model_type='llama')" in error
    assert not (tmp_path / "again").exists()


def test_a_model_type_that_is_a_long_list_is_quoted_in_one_short_line(tiny_models, tmp_path, capsys) -> None:
    """config.json's model_type is quoted as every refusal quotes a value (dataset/shown_value.py): a list of 200
    names was printed whole."""
    model, _ = _copied_model(tiny_models, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": ["llama"] * 200}))
    error = _refused(capsys, "--model_path", str(model), "--out_dir", str(tmp_path / "out"))
    # the list's repr cut at 57 characters ("['llama', " then 9 per name) and "..." added
    shown = "['llama', " + "'llama', " * 5 + "'l..."
    assert error.endswith(f"{model} is not a MiniNorm model (model_type={shown})"), error


def test_post_ln_model_is_refused_naming_the_switch(tiny_models, tmp_path, capsys) -> None:
    out = tmp_path / "llama"
    assert main(["--model_path", str(tiny_models.post_ln), "--out_dir", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "norm_placement='post'" in error and "pre-LN" in error
    assert not out.exists()


# ------------------------------------------------------------------------- a model directory loaded strictly
def _drop_weight(key: str):
    def edit(folder) -> None:
        weights = load_file(folder / "model.safetensors")
        del weights[key]
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return edit


def _set_config(**fields):
    def edit(folder) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return edit


def _poison_weight(key: str, value: float):
    def edit(folder) -> None:
        weights = load_file(folder / "model.safetensors")
        weights[key].view(-1)[3] = value
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return edit


def _cast_weight(key: str, dtype):
    def edit(folder) -> None:
        weights = load_file(folder / "model.safetensors")
        weights[key] = weights[key].round().to(dtype)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return edit


def _truncate(folder) -> None:
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:1000])


def _untied_saying_tied(folder) -> None:
    """An untied model's weights (its own lm_head.weight) under a config that says tied."""
    model = MiniNormForCausalLM.from_pretrained(folder, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    model.save_pretrained(folder)
    _set_config(tie_word_embeddings=True)(folder)


# (what is wrong, the edit of a copy of the tied tiny model, the export target that takes such a config, what the
# one-line refusal names)
MISMATCHES = [
    ("missing_tensor", _drop_weight("model.norm.weight"), "llama",
     ["missing model.norm.weight", "model.safetensors"]),
    ("tied_saved_as_untied", _set_config(tie_word_embeddings=False), "llama", ["missing lm_head.weight"]),
    ("untied_saved_as_tied", _untied_saying_tied, "llama", ["tie_word_embeddings=true", "lm_head.weight"]),
    ("qk_norm", _set_config(qk_norm=True), "qwen3",
     ["missing model.layers.0.self_attn.k_norm.weight", "and 1 more"]),
    ("num_experts", _set_config(num_experts=2, qk_norm=True), "qwen3_moe",
     ["missing model.layers.0.mlp.experts.0.down_proj.weight", "unexpected model.layers.0.mlp.down_proj.weight"]),
    ("fewer_layers", _set_config(num_hidden_layers=1), "llama", ["unexpected model.layers.1.", "and 6 more"]),
    ("more_layers", _set_config(num_hidden_layers=3), "llama",
     ["num_hidden_layers=3, but the weights in model.safetensors hold 2 layers"]),
    # the meta model's billion layers were built one by one: still running after minutes
    ("a_billion_layers", _set_config(num_hidden_layers=10**9), "llama",
     ["num_hidden_layers=1000000000, but the weights in model.safetensors hold 2 layers"]),
    ("intermediate_size", _set_config(intermediate_size=64), "llama", ["of another shape model.layers.0.mlp."]),
    # compared before from_pretrained allocates the parameter at config.json's size (an allocator's traceback)
    # (2**31 - 1, the largest vocab_size a config takes: 256 GiB of fp32 rows at width 32)
    ("vocab_size_beyond_memory", _set_config(vocab_size=2**31 - 1), "llama",
     ["of another shape", "embed_tokens.weight", "[2147483647, "]),
    # every logit NaN: chat, evaluation and the GGUF file carried it on
    ("nan_weight", _poison_weight("model.layers.1.mlp.up_proj.weight", float("nan")), "llama",
     ["model.layers.1.mlp.up_proj.weight holds 1 NaN or infinite value"]),
    ("inf_gain", _poison_weight("model.norm.weight", float("-inf")), "llama", ["model.norm.weight holds 1 NaN"]),
    ("truncated", _truncate, "llama", ["model.safetensors is not a readable safetensors file"]),
    # from_pretrained cast them to float: exported (and chatted with) silently wrong, where the import refuses them
    *[(f"{dtype}_weight", _cast_weight("model.norm.weight", getattr(torch, dtype)), "llama",
       [f"its weight model.norm.weight in model.safetensors is torch.{dtype}, not one of torch.float32, "
        "torch.bfloat16, torch.float16, torch.float64"]) for dtype in ("int32", "float8_e4m3fn")],
]


@pytest.mark.parametrize(("edit", "target", "named"), [case[1:] for case in MISMATCHES],
                         ids=[case[0] for case in MISMATCHES])
def test_weights_that_do_not_match_the_config_are_refused(tiny_models, tmp_path, capsys, edit, target,
                                                          named) -> None:
    """transformers loads such a directory with the missing weights initialised at random (and only logs it): the
    chat, evaluation and server loader (load_model) and the export refuse it in one line naming the keys."""
    model, _ = _copied_model(tiny_models, tmp_path / "model")
    edit(model)
    with pytest.raises(ValueError) as info:
        load_model(model, device="cpu")
    assert str(model) in str(info.value) and all(part in str(info.value) for part in named), info.value
    error = _refused(capsys, "--model_path", str(model), "--out_dir", str(tmp_path / "out"), "--target", target)
    assert str(model) in error and all(part in error for part in named), error
    assert not (tmp_path / "out").exists()


def _write(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def _remove(*names: str):
    def edit(folder) -> None:
        for name in names:
            (folder / name).unlink()
    return edit


def _sharded(index: str):
    """model.safetensors replaced by a shard index of text `index`."""
    def edit(folder) -> None:
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors.index.json").write_text(index)
    return edit


# (what is wrong, the edit of a copy of the tiny model, what the one-line refusal names)
BAD_INPUTS = [
    ("norm_eps_string", _set_config(norm_eps="1e-6"), ["config.json", "norm_eps='1e-6'", "finite float > 0"]),
    ("dropout_null", _set_config(dropout=None), ["config.json", "dropout=None", "[0, 1)"]),
    ("pad_token_id_string", _set_config(pad_token_id="0"), ["config.json", "pad_token_id='0'", "token id"]),
    ("intermediate_size_string", _set_config(intermediate_size="128"), ["intermediate_size='128'", "positive"]),
    ("config_not_json", _write("config.json", "{"), ["config.json"]),
    # json's RecursionError traceback, from the plain read of model_type and from AutoConfig's
    ("config_nested_too_deep", _write("config.json", "[" * 100_000 + "]" * 100_000),
     ["config.json: maximum recursion depth exceeded"]),
    ("config_integer_too_long", _write("config.json", '{"hidden_size": ' + "9" * 5000 + "}"),
     ["config.json: Exceeds the limit (4300 digits)"]),
    # transformers looked the name up on torch unchecked: an AttributeError traceback
    ("dtype_unknown", _set_config(dtype="bf16"), ["config.json", "dtype='bf16'", "'bfloat16'"]),
    ("torch_dtype_a_number", _set_config(torch_dtype=16), ["config.json", "torch_dtype=16", "'float16'"]),
    # transformers' generic fields, read unchecked: an AttributeError traceback ('str' object has no attribute ...)
    ("id2label_a_string", _set_config(id2label="x"), ["config.json: 'str' object"]),
    # taken by transformers' get_text_config for the model's own config: an AttributeError traceback (no 'to_dict')
    ("text_config_a_string", _set_config(text_config="x"),
     ["config.json: text_config='x' is not allowed", "null or absent"]),
    ("text_config_an_object", _set_config(text_config={"hidden_size": 8}),
     ["config.json: text_config={'hidden_size': 8} is not allowed", "null or absent"]),
    # transformers' quantizer asked for bitsandbytes: an ImportError traceback
    ("quantization_config_unavailable", _set_config(quantization_config={"quant_method": "bitsandbytes",
                                                                         "load_in_4bit": True}),
     ["config.json's quantization_config needs what is not installed", "bitsandbytes"]),
    # transformers refused it when building the model, in words without the file (5: an AttributeError traceback;
    # "sdpa": MiniNorm's attention is its own, a line with a link to a transformers issue)
    *[(f"attn_implementation_{what}", _set_config(_attn_implementation=value),
       [f"config.json: _attn_implementation={value!r} is not allowed; it must be null, one of 'eager', 'paged|eager' "
        "(for a mininorm model) or a hub kernel"]) for what, value in [("unknown", "bogus"), ("a_number", 5),
                                                                      ("unsupported", "sdpa")]],
    # a hub kernel whose package (kernels) is not installed: transformers' ImportError traceback as the model was built
    ("attn_implementation_kernel_not_installed", _set_config(_attn_implementation="kernels-community/flash-attn"),
     ["config.json's _attn_implementation needs what is not installed", "kernels"]),
    ("generation_config_not_json", _write("generation_config.json", "{"), ["generation_config.json"]),
    ("generation_config_a_list", _write("generation_config.json", "[]"), ["generation_config.json"]),
    # transformers keeps any value: generation stopped at int("x"), a ValueError traceback at the first message
    ("generation_config_eos_a_string", _write("generation_config.json", '{"eos_token_id": "x"}'),
     ["generation_config.json: eos_token_id='x' is not allowed",
      "a token id (an integer in 0 .. 6399, the model's vocabulary) or a list of them"]),
    # copied into the export as it was: '"bos_token_id": "x"' in a stock Llama directory
    ("generation_config_bos_a_string", _write("generation_config.json", '{"bos_token_id": "x"}'),
     ["generation_config.json: bos_token_id='x' is not allowed", "null or a token id"]),
    ("generation_config_eos_true", _write("generation_config.json", '{"eos_token_id": [2, true]}'),
     ["generation_config.json: eos_token_id=[2, True] is not allowed"]),
    # ids past the vocabulary, copied into the export as they were: a pad or bos there is the embedding's IndexError
    # in transformers' generate (a batch whose rows end apart; a generate from no prompt), and an eos never stops;
    # a pad of 2.5 padded with token 2, of true with token 1
    *[(f"generation_config_{field}_{what}", _write("generation_config.json", json.dumps({field: value})),
       [f"generation_config.json: {field}={value!r} is not allowed; it must be null{', a' if many else ' or a'} "
        f"token id (an integer in 0 .. 6399, the model's vocabulary)"])
      for field, what, value, many in [("pad_token_id", "past_the_vocabulary", 6400, False),
                                       ("pad_token_id", "negative", -1, False),
                                       ("pad_token_id", "a_float", 2.5, False),
                                       ("pad_token_id", "true", True, False),
                                       ("bos_token_id", "past_the_vocabulary", 6400, False),
                                       ("eos_token_id", "past_the_vocabulary", [2, 6400], True)]],
    # sampling, beam and length settings transformers keeps (copied into the export as they were, to fail at the
    # first generate that applies them: '`penalty` has to be a strictly positive float, but is 0', a num_beams of 0
    # its ZeroDivisionError, a temperature of 1e-300 "probability tensor contains either `inf`, `nan`"), and a
    # max_new_tokens of "x" (GenerationConfig's TypeError: '<=' not supported, without the field)
    *[(f"generation_config_{field}_{what}",
       _write("generation_config.json", json.dumps({"do_sample": True, field: value})),
       [f"generation_config.json: {field}={value!r} is not allowed; it must be {allowed}"])
      for field, what, value, allowed in [
          ("do_sample", "a_string", "yes", "null, true or false"),
          ("max_new_tokens", "a_string", "x", "null or an integer > 0"),
          ("max_new_tokens", "negative", -1, "null or an integer > 0"),
          ("temperature", "a_string", "hot", "null or a number >= 1e-05"),
          ("temperature", "negative", -1, "null or a number >= 1e-05"),
          ("temperature", "tiny", 1e-300, "null or a number >= 1e-05 (a smaller one overflows the logits)"),
          ("temperature", "nan", float("nan"), "null or a number >= 1e-05"),
          ("top_p", "above_one", 2, "null or a number in [0, 1]"),
          ("top_k", "negative", -5, "null or an integer >= 0"),
          ("repetition_penalty", "zero", 0, "null or a number in [1e-05, 100000] (1: off)"),
          ("repetition_penalty", "infinite", float("inf"), "null or a number in [1e-05, 100000]"),
          ("min_p", "above_one", 2.0, "null or a number in [0, 1]"),
          ("typical_p", "zero", 0, "null or a number in (0, 1] (1: off)"),
          ("num_beams", "zero", 0, "null or an integer >= 1"),
          ("num_beams", "a_float", 2.0, "null or an integer >= 1"),
          ("no_repeat_ngram_size", "a_float", 2.0, "null or an integer >= 0 (0: off)"),
          ("min_new_tokens", "a_float", 2.0, "null or an integer >= 0")]],
    # the other fields generate applies, each as the tiny Llama's generate (a batch of two, 4 new tokens; 0 .. 6399
    # the vocabulary) failed on it: a TypeError ('<' not supported: epsilon_cutoff, eta_cutoff, max_time "x";
    # length_penalty "x" with beams; exponential_decay_length_penalty's factor "x"; guidance_scale "x";
    # num_return_sequences 2.0; encoder_no_repeat_ngram_size, forced_eos_token_id and decoder_start_token_id "x"), the
    # processors' ValueErrors (min_length 2.0, top_h 2.0, encoder_repetition_penalty 0, max_length 0, bad_words_ids [5]
    # or past the vocabulary, sequence_bias's bias "x", suppress_tokens "x"), an IndexError (forced_eos_token_id past
    # the vocabulary, a decay penalty of one entry), prefill_chunk_size 0's RuntimeError, and "probability tensor
    # contains either `inf`, `nan`" (a sampled guidance_scale of 1e308, a sequence_bias of NaN); a watermarking_config
    # of "x" was GenerationConfig's AttributeError, without the field
    *[(f"generation_config_{field}_{what}", _write("generation_config.json", json.dumps({**others, field: value})),
       [f"generation_config.json: {field}={value!r} is not allowed; it must be {allowed}"])
      for field, what, value, others, allowed in [
          ("epsilon_cutoff", "a_string", "x", {"do_sample": True}, "null or a number in [0, 1) (0: off)"),
          ("eta_cutoff", "a_string", "x", {"do_sample": True}, "null or a number in [0, 1) (0: off)"),
          ("top_h", "above_one", 2.0, {"do_sample": True}, "null or a number in (0, 1]"),
          ("min_length", "a_float", 2.0, {}, "null or an integer >= 0"),
          ("max_length", "zero", 0, {}, "null or an integer > 0"),
          ("max_time", "a_string", "x", {}, "null or a number > 0 (seconds)"),
          ("length_penalty", "a_string", "x", {"num_beams": 2}, "null or a finite number"),
          ("num_return_sequences", "a_float", 2.0, {"do_sample": True}, "null or an integer >= 1"),
          ("encoder_repetition_penalty", "zero", 0, {}, "null or a number in [1e-05, 100000] (1: off)"),
          ("encoder_no_repeat_ngram_size", "a_string", "x", {}, "null or an integer >= 0 (0: off)"),
          ("exponential_decay_length_penalty", "one_entry", [1], {},
           "null or a pair [start, factor]: an integer >= 0 and a finite number"),
          ("exponential_decay_length_penalty", "a_string_factor", [2, "x"], {},
           "null or a pair [start, factor]: an integer >= 0 and a finite number"),
          ("guidance_scale", "a_string", "x", {}, "null or a number in [-100000, 100000] (1: off)"),
          ("guidance_scale", "huge", 1e308, {"do_sample": True}, "null or a number in [-100000, 100000]"),
          ("prefill_chunk_size", "zero", 0, {}, "null or an integer >= 1"),
          ("watermarking_config", "a_string", "x", {}, "null or a JSON object"),
          ("suppress_tokens", "a_string", "x", {},
           "null or a list of token ids (integers in 0 .. 6399, the model's vocabulary)"),
          ("begin_suppress_tokens", "a_string", "x", {}, "null or a list of token ids"),
          ("bad_words_ids", "flat", [5], {},
           "null or a non-empty list of non-empty lists of token ids (integers in 0 .. 6399, the model's vocabulary)"),
          ("bad_words_ids", "past_the_vocabulary", [[6400]], {}, "null or a non-empty list of non-empty lists"),
          ("sequence_bias", "a_string_bias", [[[5], "x"]], {},
           "null or a non-empty list of [[token ids (integers in 0 .. 6399, the model's vocabulary)], bias] pairs, "
           "each bias a finite number"),
          ("sequence_bias", "nan_bias", [[[5], float("nan")]], {"do_sample": True},
           "null or a non-empty list of [[token ids"),
          ("forced_eos_token_id", "past_the_vocabulary", 6400, {},
           "null, a token id (an integer in 0 .. 6399, the model's vocabulary) or a non-empty list of them"),
          ("forced_eos_token_id", "a_string", "x", {}, "null, a token id"),
          ("decoder_start_token_id", "a_string", "x", {}, "null or a token id (an integer in 0 .. 6399")]],
    # an integer past a float's range: math.isfinite's OverflowError traceback
    ("generation_config_temperature_past_a_float",
     _write("generation_config.json", '{"temperature": 1' + "0" * 400 + "}"),
     ["generation_config.json: temperature=1000", "is not allowed; it must be null or a number >= 1e-05"]),
    # The run's record, copied into the export for eval/chat.py: a folder in its place was left out quietly.
    ("train_config_a_folder", lambda folder: ((folder / "train_config.yaml").unlink(missing_ok=True),
                                               (folder / "train_config.yaml").mkdir()),
     ["train_config.yaml: is a directory, not a YAML file"]),
    ("train_config_not_utf8", lambda folder: (folder / "train_config.yaml").write_bytes(b"task: \xff"),
     ["train_config.yaml"]),
    ("tokenizer_garbage", _write("tokenizer.json", "{garbage"), ["tokenizer", "tokenizer.json"]),
    ("tokenizer_missing", _remove("tokenizer.json", "tokenizer_config.json"), ["no tokenizer.json"]),
    # valid JSON of another kind: transformers' words without the file ('list' object has no attribute 'get')
    ("tokenizer_a_list", _write("tokenizer.json", "[]"), ["tokenizer.json holds a list, not a JSON object"]),
    ("tokenizer_config_a_number", _write("tokenizer_config.json", "5"),
     ["tokenizer_config.json holds 5, not a JSON object"]),
    # AutoConfig's "Unrecognized model in <folder>. Should have a `model_type` key in its config.json."
    ("config_without_model_type", _write("config.json", '{"hidden_size": 64}'),
     ["config.json: has no model_type; it must name the model's architecture (such as 'mininorm'"]),
    # A sharded checkpoint's index in place of model.safetensors: an AttributeError traceback ('list' object has no
    # attribute 'values'), `KeyError: 'metadata'` for a shard that is missing or outside the folder, and an error
    # that did not name the index for text that is not JSON.
    *[(f"index_{what}", _sharded(index), ["model.safetensors.index.json", *named]) for what, index, named in [
        ("weight_map_a_list", '{"weight_map": []}', ["has no weight_map"]),
        ("missing_shard", '{"weight_map": {"lm_head.weight": "model-2.safetensors"}}',
         ["names the shard model-2.safetensors, which is missing"]),
        ("shard_outside_the_folder", '{"weight_map": {"lm_head.weight": "../../etc/passwd"}}',
         ["'../../etc/passwd'", "not a file in that folder"]),
        ("not_json", "weights: here", ["is not a JSON object"])]],
    # transformers' KeyError: 'metadata' traceback
    ("index_without_metadata", two_shards(metadata=False), ["model.safetensors.index.json has no metadata"]),
    # exported silently, with whichever copy transformers read
    ("a_tensor_in_two_shards", two_shards(twice="model.norm.weight"),
     ["its weight model.norm.weight is in two shards, model-1.safetensors and model-2.safetensors"]),
]


@pytest.mark.parametrize(("edit", "named"), [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_naming_the_file(tiny_models, tmp_path, capsys, edit, named) -> None:
    model, _ = _copied_model(tiny_models, tmp_path / "model")
    edit(model)
    error = _refused(capsys, "--model_path", str(model), "--out_dir", str(tmp_path / "llama"))
    assert str(model) in error and all(part in error for part in named), error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing written, no staging folder left


def test_an_integer_where_a_float_goes_is_that_float(tiny_models, tmp_path) -> None:
    """A temperature or repetition_penalty of 2 is 2.0, as JSON and GenerationConfig read it: transformers' logits
    processors take a float only, and the export (or the loaded model) failed at the first generate."""
    model, _ = _copied_model(tiny_models, tmp_path / "model")
    saved = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**saved, "do_sample": True, "temperature": 2,
                                                              "repetition_penalty": 2, "top_p": 1}))
    out = convert_to_llama(model, tmp_path / "llama", verify=False)
    exported = json.loads((out / "generation_config.json").read_text())
    assert [(exported[name], type(exported[name])) for name in ("temperature", "repetition_penalty", "top_p")] == \
        [(2.0, float), (2.0, float), (1.0, float)]
    ids = torch.tensor([[5, 6, 7]])
    for loaded in (AutoModelForCausalLM.from_pretrained(out), load_model(model)[0]):
        out_ids = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)  # sampled, penalized
        assert out_ids.shape[1] <= 5


@pytest.mark.parametrize("fields", [case[1] for case in ACCEPTED_GENERATION_CONFIGS],
                         ids=[case[0] for case in ACCEPTED_GENERATION_CONFIGS])
def test_real_generation_configs_are_exported_and_generate(tiny_models, tmp_path, fields) -> None:
    model, _ = _copied_model(tiny_models, tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps(fields))
    out = convert_to_llama(model, tmp_path / "llama", verify=False)
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    for loaded in (AutoModelForCausalLM.from_pretrained(out), load_model(model)[0]):
        out_ids = loaded.generate(ids, attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]), max_new_tokens=2)
        assert out_ids.shape[0] == 2 and out_ids.shape[1] <= 5


def test_an_out_dir_under_a_file_is_one_line(tiny_models, tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("keep me")
    error = _refused(capsys, "--model_path", str(tiny_models.pretrain), "--out_dir", str(tmp_path / "file" / "x"))
    assert f"{tmp_path / 'file'} is a file" in error and (tmp_path / "file").read_text() == "keep me"


def test_logits_that_differ_are_one_line_and_nothing_written(tiny_models, tmp_path, capsys, monkeypatch) -> None:
    import scripts.convert_to_llama as tool

    monkeypatch.setattr(tool, "max_logit_difference", lambda *args, **kwargs: 0.5)
    assert main(["--model_path", str(tiny_models.pretrain), "--out_dir", str(tmp_path / "llama")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "logits differ from ours by 0.5; nothing written" in error
    assert list(tmp_path.iterdir()) == []
