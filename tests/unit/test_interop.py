"""scripts/import_checkpoint.py: a transformers Llama or Qwen3 checkpoint becomes a MiniNorm model with the same
logits, which the trainers continue from; what MiniNorm cannot compute is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from model.model import MiniNormForCausalLM
from scripts.import_checkpoint import import_checkpoint, main
from tests.llama_reference import with_random_norm_gains
from tests.paths import REPO
from tests.checkpoint_shards import two_shards
from tests.generation_configs import ACCEPTED_GENERATION_CONFIGS
from tests.training_runs import run_in_process, sft_argv, train_losses

SHAPE = dict(vocab_size=6400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)
ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def hf_model(kind: str, tied: bool, seed: int = 0, **overrides):
    """A tiny randomly initialised transformers model whose norm gains are random too (not the ones at init)."""
    config_class, model_class = ARCHITECTURES[kind]
    torch.manual_seed(seed)
    config = config_class(**{**SHAPE, "tie_word_embeddings": tied,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}, **overrides})
    return with_random_norm_gains(model_class(config), 0.5)


def save_checkpoint(model, folder):
    """save_pretrained plus MiniNorm's tokenizer (its vocabulary fits SHAPE), chat template included."""
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(REPO / "model" / name, folder / name)
    return folder


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_imported_model_has_the_checkpoints_logits(kind: str, tied: bool, tmp_path) -> None:
    theirs = hf_model(kind, tied)
    source = save_checkpoint(theirs, tmp_path / "hf")
    out, diff = import_checkpoint(source, tmp_path / "imported")
    ours = MiniNormForCausalLM.from_pretrained(out, norm_impl="eager").eval()
    assert ours.config.qk_norm is (kind == "qwen3") and ours.config.tie_word_embeddings is tied
    assert ours.config.rope_theta == 5e4 and ours.config.norm_eps == 1e-5
    ids = torch.randint(0, 6400, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)
        # A KV-cached continuation (positions 40.., as generation uses) agrees too.
        prefix = ours(ids[:, :30], use_cache=True)
        torch.testing.assert_close(ours(ids[:, 30:], past_key_values=prefix.past_key_values).logits,
                                   theirs(ids).logits[:, 30:], atol=1e-5, rtol=0)
    assert diff is not None and diff <= 1e-5
    assert (ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()) is tied
    assert json.loads((out / "imported_from.json").read_text())["model_type"] == kind


def test_a_yarn_checkpoint_keeps_its_rope_scaling(tmp_path) -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16}
    theirs = hf_model("qwen3", True, rope_parameters={**yarn, "rope_theta": 5e4})
    out, _ = import_checkpoint(save_checkpoint(theirs, tmp_path / "hf"), tmp_path / "imported")
    ours = MiniNormForCausalLM.from_pretrained(out, norm_impl="eager").eval()
    assert ours.config.rope_scaling == yarn and ours.config.rope_theta == 5e4
    ids = torch.randint(0, 6400, (1, 128), generator=torch.Generator().manual_seed(4))  # 4x the original length
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_tokenizer_and_chat_template_come_along(tmp_path, tokenizer) -> None:
    source = save_checkpoint(hf_model("qwen3", True), tmp_path / "hf")
    out, _ = import_checkpoint(source, tmp_path / "imported", verify=False)
    imported = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Hi 你好"}]
    assert imported.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False)
    assert imported("The history of 北京")["input_ids"] == tokenizer("The history of 北京")["input_ids"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fine_tuning_continues_from_an_import(kind: str, tmp_path, train_data) -> None:
    source = save_checkpoint(hf_model(kind, tied=kind == "llama"), tmp_path / "hf")
    imported, _ = import_checkpoint(source, tmp_path / "imported")
    out = tmp_path / "sft"
    run_in_process("sft", sft_argv(train_data, imported, out, "--tokenizer_path", str(imported)))
    losses = train_losses(out)
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    trained = MiniNormForCausalLM.from_pretrained(out)
    assert trained.config.qk_norm is (kind == "qwen3")
    start = load_file(imported / "model.safetensors")
    assert not torch.equal(load_file(out / "model.safetensors")["model.layers.0.mlp.up_proj.weight"],
                           start["model.layers.0.mlp.up_proj.weight"])  # the imported weights were trained


def _with_layernorms(model):
    """The transformers model with every RMSNorm (QK-norms included) replaced by torch's nn.LayerNorm carrying the
    same gain and a zero bias: the independent reference for an import with --norm_type layernorm."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                layer_norm = torch.nn.LayerNorm(child.weight.shape[0], eps=child.variance_epsilon)
                with torch.no_grad():
                    layer_norm.weight.copy_(child.weight)
                setattr(parent, name, layer_norm)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_an_import_can_swap_the_norm_keeping_the_gains(kind: str, tmp_path, capsys) -> None:
    theirs = hf_model(kind, tied=True)
    source = save_checkpoint(theirs, tmp_path / "hf")
    ids = torch.randint(0, 6400, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        original = theirs(ids).logits
    assert main(["--source", str(source), "--out_dir", str(tmp_path / "ln"), "--norm_type", "layernorm"]) == 0
    assert "norm_type='layernorm', max logit difference" in capsys.readouterr().out
    ours = MiniNormForCausalLM.from_pretrained(tmp_path / "ln", norm_impl="eager").eval()
    assert ours.config.norm_type == "layernorm" and ours.config.qk_norm is (kind == "qwen3")
    assert not ours.model.layers[0].mlp_norm.bias.any()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, _with_layernorms(theirs)(ids).logits, atol=1e-5, rtol=0)
        assert (ours(ids).logits - original).abs().max() > 1e-3  # a different function from the checkpoint's
    recorded = json.loads((tmp_path / "ln" / "imported_from.json").read_text())
    assert recorded["norm_type"] == "layernorm" and recorded["max_logit_difference"] > 1e-3
    # imported again over it: the line says what it replaced (the default --out_dir is every import's)
    assert main(["--source", str(source), "--out_dir", str(tmp_path / "ln"), "--norm_type", "layernorm",
                 "--no_verify"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"; it replaced the earlier import there, of {source.resolve()}")


def test_a_dyt_import_starts_alpha_at_its_init(tmp_path) -> None:
    source = save_checkpoint(hf_model("qwen3", tied=False), tmp_path / "hf")
    out, _ = import_checkpoint(source, tmp_path / "dyt", norm_type="dyt")
    ours = MiniNormForCausalLM.from_pretrained(out)
    assert ours.config.norm_type == "dyt"
    norm = ours.model.layers[1].self_attn.q_norm
    assert norm.alpha.item() == ours.config.dyt_alpha_init and not norm.bias.any()
    torch.testing.assert_close(norm.weight, load_file(source / "model.safetensors")[
        "model.layers.1.self_attn.q_norm.weight"], atol=0, rtol=0)


def test_a_norm_without_a_gain_to_keep_is_refused(tmp_path, capsys) -> None:
    source = save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf")
    with pytest.raises(SystemExit):
        main(["--source", str(source), "--out_dir", str(tmp_path / "x"), "--norm_type", "none"])
    assert "invalid choice: 'none'" in capsys.readouterr().err


def _refused(capsys, source, out) -> str:
    capsys.readouterr()  # the test's own save_pretrained may have drawn a progress bar (the first in a process)
    assert main(["--source", str(source), "--out_dir", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and not out.exists()
    return error


@pytest.mark.parametrize(("kind", "overrides", "named"), [
    ("llama", dict(attention_bias=True), "attention_bias=True"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), "use_sliding_window=True"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_what_does_not_map_is_refused_in_one_line(kind, overrides, named, tmp_path, capsys) -> None:
    config_class = ARCHITECTURES[kind][0]
    config = config_class(**{**SHAPE, **overrides})
    config.save_pretrained(tmp_path / "hf")  # the refusal comes before any weight is needed
    error = _refused(capsys, tmp_path / "hf", tmp_path / "imported")
    assert named in error and str(tmp_path / "hf") in error


def test_a_qwen3_config_without_num_key_value_heads_reads_as_transformers_reads_it(tmp_path, capsys) -> None:
    """Qwen3Config's default of 32 KV heads is not what the other sizes imply: a config.json without
    num_key_value_heads is a model of 32 KV heads to transformers, which the import read as num_attention_heads and
    then refused the weights' shapes, saying config.json gave what it never said; it now names the value transformers
    reads, before any weight."""
    Qwen3Config(**SHAPE).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["num_key_value_heads"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    error = _refused(capsys, tmp_path / "hf", tmp_path / "imported")
    assert "num_key_value_heads=32" in error and "model.safetensors" not in error, error


def test_a_qwen3_config_without_head_dim_imports_heads_of_128(tmp_path) -> None:
    """Qwen3Config's unset head_dim is 128 whatever hidden_size / num_attention_heads (8 here): a config.json that
    leaves it out imports as transformers reads it, 128-wide heads, with transformers' logits for that directory."""
    theirs = hf_model("qwen3", tied=True, head_dim=128)
    source = save_checkpoint(theirs, tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    del config["head_dim"]
    (source / "config.json").write_text(json.dumps(config))
    reloaded = Qwen3ForCausalLM.from_pretrained(source).eval()
    assert reloaded.config.head_dim == 128
    out, _ = import_checkpoint(source, tmp_path / "imported")
    ours = MiniNormForCausalLM.from_pretrained(out, norm_impl="eager").eval()
    assert ours.config.head_dim == 128 and ours.model.layers[0].self_attn.q_proj.weight.shape == (4 * 128, 32)
    ids = torch.randint(0, 6400, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reloaded(ids).logits, atol=1e-5, rtol=0)


def test_fields_left_out_of_a_llama_config_read_as_llamaconfigs_defaults(tmp_path) -> None:
    """LlamaConfig derives what a config.json leaves out from the other sizes (num_key_value_heads: the attention
    heads; head_dim: hidden_size / heads), unlike Qwen3Config's fixed 32 and 128, and reads tie_word_embeddings as
    False and rope_theta as 10000: a Llama without those fields (and 4 KV heads) imports with transformers' logits
    for that very directory."""
    theirs = hf_model("llama", tied=False, num_key_value_heads=4,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    source = save_checkpoint(theirs, tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    for field in ("num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_parameters", "rope_theta",
                  "rope_scaling"):
        config.pop(field, None)
    (source / "config.json").write_text(json.dumps(config))
    reloaded = LlamaForCausalLM.from_pretrained(source).eval()  # as transformers reads the stripped config.json
    assert (reloaded.config.num_key_value_heads, reloaded.config.head_dim) == (4, 8)
    out, _ = import_checkpoint(source, tmp_path / "imported")
    ours = MiniNormForCausalLM.from_pretrained(out, norm_impl="eager").eval()
    assert (ours.config.num_key_value_heads, ours.config.head_dim, ours.config.rope_theta) == (4, 8, 1e4)
    assert ours.config.tie_word_embeddings is False
    ids = torch.randint(0, 6400, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reloaded(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tokenizer_eos, written, expected", [
    (None, {}, (1, 2, None)),  # no tokenizer: LlamaConfig's bos 1 and eos 2, as transformers reads the directory
    ("<|endoftext|>", {}, (1, 0, 0)),  # the tokenizer's eos and pad; it names no bos: LlamaConfig's
    ("<|endoftext|>", {"eos_token_id": None, "bos_token_id": 5}, (5, None, 0)),  # given in config.json: kept
], ids=["no_tokenizer", "tokenizer", "written"])
def test_special_token_ids_left_out_of_a_llama_config_read_as_the_tokenizer_then_transformers_name_them(
        tokenizer_eos, written, expected, tmp_path) -> None:
    """A config.json without bos/eos/pad_token_id: transformers reads LlamaConfig's 1 and 2 (and no pad), and the
    checkpoint's tokenizer, where it names one, has the ids its text is tokenized with; the import read all three as
    None (its config.json, and an export of it, naming no eos)."""
    source = save_checkpoint(hf_model("llama", tied=False), tmp_path / "hf")
    config = {key: value for key, value in json.loads((source / "config.json").read_text()).items()
              if key not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (source / "config.json").write_text(json.dumps({**config, **written}))
    (source / "generation_config.json").unlink()
    if tokenizer_eos is None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (source / name).unlink()
    else:
        tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
        (source / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": tokenizer_eos}))
        tokenizer = AutoTokenizer.from_pretrained(source)
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (None, 0, 0)
    if not written:
        assert LlamaConfig.from_pretrained(source).eos_token_id == 2  # transformers' reading of the directory
    out, _ = import_checkpoint(source, tmp_path / "imported", verify=False)
    ours = MiniNormForCausalLM.from_pretrained(out).config
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == expected


def test_a_qwen3_configs_null_num_key_value_heads_reads_as_its_attention_heads(tmp_path) -> None:
    """Qwen3Config's default of 32 KV heads is for a field config.json leaves out; one it writes as null is the
    attention heads' number to transformers (Qwen3Config.__post_init__), so the import reads 4 here, with
    transformers' logits for that very directory."""
    theirs = hf_model("qwen3", tied=False, num_key_value_heads=4)
    source = save_checkpoint(theirs, tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    config["num_key_value_heads"] = None
    (source / "config.json").write_text(json.dumps(config))
    reloaded = Qwen3ForCausalLM.from_pretrained(source).eval()
    assert reloaded.config.num_key_value_heads == 4
    out, _ = import_checkpoint(source, tmp_path / "imported")
    ours = MiniNormForCausalLM.from_pretrained(out, norm_impl="eager").eval()
    assert ours.config.num_key_value_heads == 4
    ids = torch.randint(0, 6400, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reloaded(ids).logits, atol=1e-5, rtol=0)


def test_an_unsupported_rope_type_is_refused(tmp_path, capsys) -> None:
    config = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64})
    config.save_pretrained(tmp_path / "hf")
    assert "rope_type='llama3'" in _refused(capsys, tmp_path / "hf", tmp_path / "imported")


def test_another_architecture_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert "model_type='gpt2'" in _refused(capsys, tmp_path / "hf", tmp_path / "imported")


def test_a_tied_config_with_its_own_lm_head_is_refused(tmp_path, capsys) -> None:
    source = save_checkpoint(hf_model("llama", tied=False), tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    error = _refused(capsys, source, tmp_path / "imported")
    assert "tie_word_embeddings=True" in error and "lm_head.weight" in error


def test_an_untied_config_without_lm_head_is_refused(tmp_path, capsys) -> None:
    source = save_checkpoint(hf_model("llama", tied=False), tmp_path / "hf")
    weights = load_file(source / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    error = _refused(capsys, source, tmp_path / "imported")
    assert "tie_word_embeddings=False" in error and "no lm_head.weight" in error


def test_a_folder_that_is_not_an_import_is_left_alone(tmp_path, capsys) -> None:
    source = save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["--source", str(source), "--out_dir", str(out)]) == 2
    assert "neither empty nor an earlier import" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert main(["--source", str(source), "--out_dir", str(tmp_path / "imported")]) == 0
    assert main(["--source", str(source), "--out_dir", str(tmp_path / "imported"), "--no_verify"]) == 0  # replaced


# ---------------------------------------------------------------------- bad input: one line naming file and field
def _set_config(**fields):
    def edit(folder) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return edit


def _drop_config(field: str):
    def edit(folder) -> None:
        config = json.loads((folder / "config.json").read_text())
        del config[field]
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _write(name: str, content: object):
    return lambda folder: (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))


def _truncate(folder) -> None:
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:1000])


def _edit_weight(key: str, edit):
    def edit_file(folder) -> None:
        weights = load_file(folder / "model.safetensors")
        weights[key] = edit(weights[key])
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return edit_file


def _index_naming_the_norm_twice(folder) -> None:
    two_shards()(folder)
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('{"weight_map": {', '{"weight_map": {"model.norm.weight": "x", ', 1))


def _qwen3_labelled_llama(folder) -> None:
    for file in folder.iterdir():
        file.unlink()
    save_checkpoint(hf_model("qwen3", tied=True), folder)
    _set_config(model_type="llama")(folder)


# (what is wrong, the edit of a copy of a tiny tied Llama checkpoint, what the one-line refusal names)
BAD_SOURCES = [
    *[(f"no_{field}", _drop_config(field), [f"config.json has no {field}"])
      for field in ("num_attention_heads", "hidden_size", "vocab_size", "intermediate_size",
                    "max_position_embeddings")],
    # "model_type=None cannot be imported": absent, not null, and without the file
    ("no_model_type", _drop_config("model_type"),
     ["its config.json has no model_type; it must be one of 'llama', 'qwen3'"]),
    # transformers' words without the file: 'int' object has no attribute 'pop' / 'list' object has no attribute 'get'
    ("tokenizer_a_number", _write("tokenizer.json", "5"), ["tokenizer.json holds 5, not a JSON object"]),
    ("tokenizer_config_a_list", _write("tokenizer_config.json", []),
     ["tokenizer_config.json holds a list, not a JSON object"]),
    ("zero_heads", _set_config(num_attention_heads=0), ["num_attention_heads=0", "positive integer"]),
    ("string_heads", _set_config(num_attention_heads="4"), ["num_attention_heads='4'", "positive integer"]),
    ("string_eps", _set_config(rms_norm_eps="1e-5"), ["norm_eps='1e-5'", "finite float > 0"]),
    ("config_a_list", _write("config.json", "[]"), ["config.json is not a JSON object"]),
    ("config_not_json", _write("config.json", "{"), ["config.json"]),
    # json's RecursionError traceback; and a ValueError that did not name the file
    ("config_nested_too_deep", _write("config.json", "[" * 100_000 + "]" * 100_000),
     ["config.json: not readable JSON (maximum recursion depth exceeded"]),
    ("config_integer_too_long", _write("config.json", '{"hidden_size": ' + "9" * 5000 + "}"),
     ["config.json: not readable JSON (Exceeds the limit (4300 digits)"]),
    # read by the tokenizer's loading first: "cannot read the tokenizer ...: module 'torch' has no attribute 'bf16'"
    ("dtype_unknown", _set_config(dtype="bf16"), ["config.json: dtype='bf16' is not allowed", "'bfloat16'"]),
    # transformers' line without the file ('Specified `attn_implementation="bogus"` is not supported. ...'), at the
    # logit check after the work (with --no_verify the import was written)
    ("attn_implementation_unknown", _set_config(_attn_implementation="bogus"),
     ["config.json: _attn_implementation='bogus' is not allowed; it must be null, one of 'eager', ",
      "'sdpa', 'paged|eager' (for a llama model) or a hub kernel ('org/name')"]),
    # flash-attn is not installed: transformers' ImportError traceback at the logit check, after the work
    ("attn_implementation_not_installed", _set_config(_attn_implementation="flash_attention_2"),
     ["config.json's _attn_implementation needs what is not installed", "--no_verify skips the check"]),
    ("qwen3_labelled_llama", _qwen3_labelled_llama, ["unexpected model.layers.0.self_attn.k_norm.weight"]),
    # RoPE rotates pairs: an odd head width is no MiniNorm head (transformers refuses it too, but a file may say it)
    ("odd_head_dim", _set_config(head_dim=7), ["head_dim=7", "positive even integer"]),
    ("head_dim_disagrees", _set_config(head_dim=16), ["of another shape model.layers.", "_proj.weight", "and 7 more"]),
    ("intermediate_size_disagrees", _set_config(intermediate_size=128),
     ["of another shape model.layers.0.mlp.down_proj.weight", "[32, 64]", "[32, 128]"]),
    ("truncated", _truncate, ["model.safetensors is not a readable safetensors file"]),
    ("missing_shard", _write("model.safetensors.index.json", {"weight_map": {"a": "model-2.safetensors"}}),
     ["model.safetensors.index.json", "model-2.safetensors", "missing"]),
    ("index_without_weight_map", _write("model.safetensors.index.json", {"metadata": {}}),
     ["model.safetensors.index.json has no weight_map"]),
    # transformers' KeyError: 'metadata' traceback at the logits check, after the work
    ("index_without_metadata", two_shards(metadata=False), ["model.safetensors.index.json has no metadata"]),
    # imported silently: whichever shard was read last gave the tensor
    ("a_tensor_in_two_shards", two_shards(twice="model.norm.weight"),
     ["its weight model.norm.weight is in two shards, model-1.safetensors and model-2.safetensors"]),
    # the entry Python's json keeps is the last; the index is read strictly
    ("index_naming_a_tensor_twice", _index_naming_the_norm_twice,
     ['model.safetensors.index.json has a duplicate key "model.norm.weight"']),
    ("shard_outside_the_folder", _write("model.safetensors.index.json", {"weight_map": {"a": "../../etc/passwd"}}),
     ["'../../etc/passwd'", "not a file in that folder"]),
    ("partial_rotary_factor", _set_config(rope_parameters={"rope_type": "default", "rope_theta": 5e4,
                                                           "partial_rotary_factor": 0.5}),
     ["partial_rotary_factor=0.5"]),
    ("string_rope_parameters", _set_config(rope_parameters="default"), ["rope_parameters='default'", "object"]),
    # transformers takes the legacy field then: the logit check failed without naming either
    ("rope_scaling_disagrees_with_rope_parameters", _set_config(rope_scaling={"rope_type": "linear", "factor": 4.0}),
     ["both rope_parameters=", "rope_scaling={'rope_type': 'linear', 'factor': 4.0}", "disagree"]),
    # .float() made them weights
    ("integer_weight", _edit_weight("model.norm.weight", lambda weight: weight.round().to(torch.int32)),
     ["model.norm.weight in model.safetensors is torch.int32, not one of torch.float32"]),
    # --no_verify wrote it; chat and GGUF carried the NaN logits on
    ("nan_weight", _edit_weight("model.layers.0.mlp.up_proj.weight", lambda weight: weight / 0.0 * 0.0),
     ["model.layers.0.mlp.up_proj.weight holds 2048 NaN or infinite values (of 2048)"]),
    # transformers' strict config classes: a StrictDataclassClassValidationError (or FieldValidationError) traceback
    ("hidden_size_not_a_multiple_of_the_heads", _set_config(hidden_size=30),
     ["config.json: The hidden size (30) is not a multiple of the number of attention heads (4)"]),
    ("layer_types_of_another_length", _set_config(layer_types=["full_attention"]),
     ["config.json: `num_hidden_layers` (2) must be equal to the number of `layer_types` (1)"]),
    ("pretraining_tp_a_float", _set_config(pretraining_tp=1.0), ["config.json: Field 'pretraining_tp'"]),
    # the meta model's billion layers were built one by one: still running after minutes
    ("a_billion_layers", _set_config(num_hidden_layers=10**9),
     ["num_hidden_layers=1000000000, but its weights hold 2 layers"]),
    # transformers asked for bitsandbytes (an ImportError traceback); the tensors alone are not the weights
    ("quantized", _set_config(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}),
     ["quantization_config={'quant_method': 'bitsandbytes', 'load_in_4bit': True} is not supported", "unquantized"]),
    # torch.isfinite has no float8 kernel: a NotImplementedError traceback; and .float() drops the scales
    ("float8_weight", _edit_weight("model.layers.0.mlp.up_proj.weight", lambda weight: weight.to(torch.float8_e4m3fn)),
     ["model.layers.0.mlp.up_proj.weight in model.safetensors is torch.float8_e4m3fn, not one of torch.float32"]),
    # the import was written without them (exit 0): a tokenizer_config.json without its tokenizer.json
    *[(f"{name}_a_folder", lambda folder, name=name: ((folder / name).unlink(missing_ok=True), (folder / name).mkdir()),
       [f"{name} is a folder, not a file"]) for name in ("tokenizer.json", "chat_template.jinja")],
    # transformers reads it, but would not save it: the import failed at its end, in several lines
    ("unsavable_generation_config", _write("generation_config.json", {"temperature": 0.5}),
     ["generation_config.json: `temperature`", "would not save it"]),
    # imported as it was: the imported model's first chat message was a ValueError traceback (int("x"))
    ("generation_config_eos_a_string", _write("generation_config.json", {"eos_token_id": "x"}),
     ["generation_config.json: eos_token_id='x' is not allowed"]),
    # imported as it was, into the import's generation_config.json
    ("generation_config_bos_a_string", _write("generation_config.json", {"bos_token_id": "x"}),
     ["generation_config.json: bos_token_id='x' is not allowed", "null or a token id"]),
    # imported as it was (transformers keeps it when do_sample is true): a sampled generate's ValueError
    ("generation_config_temperature_negative", _write("generation_config.json", {"do_sample": True, "temperature": -1}),
     ["generation_config.json: temperature=-1 is not allowed; it must be null or a number >= 1e-05"]),
    # imported as they were: a sampled generate's '`penalty` has to be a strictly positive float, but is 0.0', the
    # embedding's IndexError once a row of a batch ends (pad_token_id past the checkpoint's 6,400 tokens)
    ("generation_config_repetition_penalty_zero", _write("generation_config.json", {"repetition_penalty": 0.0}),
     ["generation_config.json: repetition_penalty=0.0 is not allowed; it must be null or a number in [1e-05, "]),
    ("generation_config_pad_past_the_vocabulary", _write("generation_config.json", {"pad_token_id": 6400}),
     ["generation_config.json: pad_token_id=6400 is not allowed; it must be null or a token id (an integer in "
      "0 .. 6399, the model's vocabulary)"]),
    ("generation_config_do_sample_a_string", _write("generation_config.json", {"do_sample": "yes"}),
     ["generation_config.json: do_sample='yes' is not allowed; it must be null, true or false"]),
    # imported as they were: the imported Llama's generate raised '<' not supported (epsilon_cutoff "x", sampled),
    # `min_length` has to be a non-negative integer (2.0), ** not supported (length_penalty "x" with beams), `top_h`
    # must be in the range (0, 1] (2.0, sampled), and an IndexError (forced_eos_token_id past the 6,400 tokens)
    *[(f"generation_config_{field}", _write("generation_config.json", {**others, field: value}),
       [f"generation_config.json: {field}={value!r} is not allowed; it must be {allowed}"])
      for field, value, others, allowed in [
          ("epsilon_cutoff", "x", {"do_sample": True}, "null or a number in [0, 1) (0: off)"),
          ("min_length", 2.0, {}, "null or an integer >= 0"),
          ("length_penalty", "x", {"num_beams": 2}, "null or a finite number"),
          ("top_h", 2.0, {"do_sample": True}, "null or a number in (0, 1]"),
          ("forced_eos_token_id", 6400, {}, "null, a token id (an integer in 0 .. 6399, the model's vocabulary) or "
           "a non-empty list of them")]],
]


@pytest.mark.parametrize("fields", [case[1] for case in ACCEPTED_GENERATION_CONFIGS],
                         ids=[case[0] for case in ACCEPTED_GENERATION_CONFIGS])
def test_real_generation_configs_are_imported_and_generate(tmp_path, fields) -> None:
    source = save_checkpoint(hf_model("qwen3", True), tmp_path / "hf")
    (source / "generation_config.json").write_text(json.dumps(fields))
    out, _ = import_checkpoint(source, tmp_path / "imported", verify=False)
    imported = MiniNormForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    out_ids = imported.generate(ids, attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]), max_new_tokens=2)
    assert out_ids.shape[0] == 2 and out_ids.shape[1] <= 5


@pytest.mark.parametrize(("edit", "named"), [case[1:] for case in BAD_SOURCES], ids=[case[0] for case in BAD_SOURCES])
def test_bad_input_is_one_line_naming_the_file_and_field(tmp_path, capsys, edit, named) -> None:
    source = save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf")
    edit(source)
    error = _refused(capsys, source, tmp_path / "imported")
    assert str(source) in error and all(part in error for part in named), error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written, no staging folder left


@pytest.mark.parametrize(("edit", "named", "whole"), [
    # a Qwen3-style list of one entry per layer: it was quoted whole, 48 entries on one line
    (_set_config(layer_types=["full_attention"] * 47 + ["sliding_attention"]),
     "layer_types[47]='sliding_attention' is not supported; MiniNorm attends to the whole context in every layer "
     "(full_attention)", "'full_attention', 'full_attention'"),
    (_set_config(rope_scaling={"rope_type": "linear", "factor": 4.0, "note": "n" * 300}),
     # the dict's repr cut at 57 characters (48 before the n's), "..." added
     "rope_scaling={'rope_type': 'linear', 'factor': 4.0, 'note': '" + "n" * 9 + "..., which disagree", "n" * 100),
])
def test_a_long_refused_value_is_named_in_a_short_line(tmp_path, capsys, edit, named, whole) -> None:
    """The refusal quotes a long value as shown_value does (cut at MAX_SHOWN characters) or names the one entry that
    is refused, never the whole list or dict."""
    from dataset.shown_value import MAX_SHOWN

    source = save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf")
    edit(source)
    error = _refused(capsys, source, tmp_path / "imported")
    assert named in error and whole not in error, error
    assert len(error) < len(f"error: cannot import {source}: ") + 2 * MAX_SHOWN + 150, error


def test_agreeing_rope_parameters_and_rope_scaling_import(tmp_path) -> None:
    """A config.json with both RoPE fields saying the same (the legacy one written next to the new) imports."""
    source = save_checkpoint(hf_model("llama", tied=True, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                           "rope_theta": 5e4}), tmp_path / "hf")
    _set_config(rope_theta=5e4, rope_scaling={"type": "linear", "factor": 2.0})(source)
    out, diff = import_checkpoint(source, tmp_path / "imported")
    assert diff < 1e-4 and MiniNormForCausalLM.from_pretrained(out).config.rope_scaling["factor"] == 2.0


def test_a_config_beyond_memory_is_refused_by_shape_when_swapping_norms(tmp_path, capsys) -> None:
    """With swapped norms the model is built for real: a vocab_size no memory holds was the allocator's traceback;
    the shapes are compared first."""
    source = save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf")
    _set_config(vocab_size=2**31 - 1)(source)  # the largest a config takes: 256 GiB of fp32 embedding rows
    capsys.readouterr()  # the save's progress bars (shown where no earlier test turned them off)
    assert main(["--source", str(source), "--out_dir", str(tmp_path / "imported"), "--norm_type", "layernorm"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "of another shape" in error and "[2147483647, 32]" in error


def test_a_sharded_checkpoint_in_the_hub_cache_layout_imports(tmp_path) -> None:
    """The Hugging Face hub cache (what from_pretrained and snapshot_download leave) links every file of
    snapshots/REV/ to ../../blobs/SHA: a shard is named in the folder and lives elsewhere. It was refused as 'not a
    file in that folder'."""
    theirs = hf_model("llama", tied=False)
    saved = tmp_path / "saved"
    theirs.save_pretrained(saved, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(REPO / "model" / name, saved / name)
    assert len(list(saved.glob("model-*.safetensors"))) > 1
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(saved.iterdir())):
        shutil.move(file, blobs / f"blob{number}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{number}")
    out, diff = import_checkpoint(snapshot, tmp_path / "imported")
    assert diff is not None and diff <= 1e-5


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_import_and_at_load(tmp_path, capsys) -> None:
    """A 100-token model with a 6,400-token tokenizer was imported, exported and written to GGUF without a word,
    then failed in chat and evaluate with an IndexError traceback from the embedding."""
    from model.loading import load_model

    source = save_checkpoint(hf_model("llama", tied=True, vocab_size=100), tmp_path / "hf")
    error = _refused(capsys, source, tmp_path / "imported")
    assert error == (f"error: {source}: its tokenizer has 6400 tokens, more than the model's vocab_size=100 "
                     f"(config.json): ids from 100 on have no embedding; give the model the tokenizer it was "
                     f"trained with")
    fits = import_checkpoint(save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf2"), tmp_path / "ok")[0]
    config = json.loads((fits / "config.json").read_text())
    small = tmp_path / "small"
    shrunk = MiniNormForCausalLM.from_pretrained(fits)
    shrunk.resize_token_embeddings(100)
    shrunk.save_pretrained(small)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(fits / name, small / name)
    assert config["vocab_size"] == 6400
    with pytest.raises(ValueError, match=r"its tokenizer has 6400 tokens, more than the model's vocab_size=100"):
        load_model(small, device="cpu")


def test_an_out_dir_under_a_file_is_one_line(tmp_path, capsys) -> None:
    source = save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf")
    (tmp_path / "file").write_text("keep me")
    assert main(["--source", str(source), "--out_dir", str(tmp_path / "file" / "x")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"{tmp_path / 'file'} is a file" in error


def test_saved_rope_inverse_frequencies_are_ignored_as_transformers_does(tmp_path) -> None:
    """Older checkpoints saved each layer's rotary_emb.inv_freq; they follow from rope_theta."""
    theirs = hf_model("llama", tied=True)
    source = save_checkpoint(theirs, tmp_path / "hf")
    weights = load_file(source / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    _, diff = import_checkpoint(source, tmp_path / "imported")
    assert diff is not None and diff <= 1e-5


def test_a_model_folder_whose_tokenizer_has_no_eos_is_one_line(tmp_path) -> None:
    """Without tokenizer_config.json the tokenizer has no eos: chat raised 'generation could not stop' as a
    traceback and the GGUF writer a struct.error; convert_to_llama exported the defect."""
    from model.loading import load_dir_tokenizer

    folder = save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf")
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError) as refused:
        load_dir_tokenizer(folder)
    assert str(refused.value) == (f"the tokenizer of {folder} has no eos token: no tokenizer_config.json there "
                                  f"(the file that names it)")


@pytest.mark.parametrize("field", ["eos_token", "pad_token"])
def test_a_special_token_tokenizer_json_lacks_is_named_in_one_line(tmp_path, field) -> None:
    """tokenizer_config.json naming an eos (or pad) token that tokenizer.json does not hold: transformers added it
    as a new token, one past the model's vocab_size here, and the refusal named the tokenizer's size ("has 6401
    tokens, more than the model's vocab_size=6400"), not the field; with room in the vocabulary it would have been
    an id the model never trained, and generation would not stop."""
    from model.loading import load_dir_tokenizer

    folder = save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf")
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), field: "<nope>"}))
    with pytest.raises(ValueError) as refused:
        load_dir_tokenizer(folder)
    assert str(refused.value) == (f"{config_file}: {field}='<nope>' is not a token of its tokenizer.json; name one "
                                  f"that file holds")


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_tokenizer_file_that_is_not_utf8_is_named(tmp_path, name) -> None:
    """A chat_template.jinja (or tokenizer_config.json) whose bytes are not UTF-8 was "tokenizer.json /
    tokenizer_config.json: 'utf-8' codec can't decode byte 0xff in position 2": no file, or the wrong ones."""
    from model.loading import load_dir_tokenizer

    folder = save_checkpoint(hf_model("llama", tied=True), tmp_path / "hf")
    (folder / name).write_bytes(b"{}\xff")
    with pytest.raises(ValueError) as refused:
        load_dir_tokenizer(folder)
    assert str(refused.value) == (f"cannot read the tokenizer of {folder}: {name}: not valid UTF-8 (byte 0xff at "
                                  f"offset 2)")
