"""A LoRA adapter directory (--lora of chat, evaluate, the server) is checked before PEFT reads it
(model/adapter_checks.py): each bad adapter_config.json field, and a weights file that is missing, unreadable or
holds other tensors than the config implies, is one line naming the file and field, where it was a traceback from
PEFT or torch, or an adapter loaded as something else without a word. A sound adapter still loads to the very
logits PEFT's own loading gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.loading import load_model, load_strictly
from trainer.run_dir import ModelNotFound, locate_model_and_adapter

RANK = 4
SMALLEST_SIDE = 32  # the tiny model's k_proj and v_proj: 64 -> 2 key/value heads of 16
IDS = torch.tensor([[1, 200, 300, 400, 2, 77, 88]])


@pytest.fixture(scope="module")
def adapter(tokenizer, tmp_path_factory) -> tuple[Path, Path]:
    """(base model directory, adapter directory): a tiny model and a rank-4 adapter of all seven projections, its
    B matrices random (a fresh adapter's are zero, and would not change the logits), written as
    trainer/train_lora.py writes one."""
    from model.lora import LoraSettings, add_lora
    from tests.conftest import _perturbed, _save_tiny, _tiny_model
    from trainer.export import save_model_dir

    root = tmp_path_factory.mktemp("adapter")
    base = _save_tiny(_perturbed(_tiny_model(tokenizer, seed=1)), tokenizer, root / "base", "sft")
    adapted = add_lora(_tiny_model(tokenizer, seed=1), LoraSettings(rank=RANK))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    save_model_dir(adapted, tokenizer, root / "lora")
    config_file = root / "lora" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "base_model_name_or_path": str(base)}))
    return base, root / "lora"


def _config(**fields):
    """Set fields of adapter_config.json (a field given "DELETE" is removed)."""
    def edit(folder: Path) -> None:
        file = folder / "adapter_config.json"
        config = json.loads(file.read_text())
        config.update(fields)
        for key in [key for key, value in config.items() if value == "DELETE"]:
            del config[key]
        file.write_text(json.dumps(config))
    return edit


def _config_bytes(data: bytes):
    return lambda folder: (folder / "adapter_config.json").write_bytes(data)


def _weights(change):
    """Rewrite adapter_model.safetensors with `change` applied to its {name: tensor} dict."""
    def edit(folder: Path) -> None:
        file = folder / "adapter_model.safetensors"
        tensors = load_file(file)
        change(tensors)
        save_file(tensors, file, metadata={"format": "pt"})
    return edit


def _weights_bytes(cut):
    def edit(folder: Path) -> None:
        file = folder / "adapter_model.safetensors"
        file.write_bytes(cut(file.read_bytes()))
    return edit


def _no_weights(folder: Path) -> None:
    (folder / "adapter_model.safetensors").unlink()


DOWN_A_KEY = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"  # the first by name
A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_KEY = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
TARGETS = "list of the model's linear layers (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)"
LEFT_OFF = "is not allowed; this option is not supported when loading an adapter; it must be null, false or empty"

# (what is wrong, the edit of a copy of the adapter, the file it names, what the one-line refusal says)
BAD_ADAPTERS = [
    ("config_a_list", _config_bytes(b"[]"), "adapter_config.json", ["holds [], not a JSON object"]),
    ("config_not_json", _config_bytes(b"{"), "adapter_config.json", ["is not valid JSON"]),
    ("config_not_utf8", _config_bytes(b'{"r": "\xe9"}'), "adapter_config.json", ["is not valid UTF-8 (byte 0xe9"]),
    # lora_alpha NaN: evaluate printed loss nan and exited 0
    ("alpha_nan", _config_bytes(b'{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}'), "adapter_config.json",
     ["is not valid JSON (NaN is not a JSON number)"]),
    ("peft_type_other", _config(peft_type="NOPE"), "adapter_config.json",
     ["peft_type='NOPE' is not allowed; it must be 'LORA'"]),
    ("peft_type_missing", _config(peft_type="DELETE"), "adapter_config.json", ["peft_type is missing; it must be"]),
    ("r_a_string", _config(r="8"), "adapter_config.json",
     [f"r='8' is not allowed; it must be an integer in 1 .. {SMALLEST_SIDE}"]),
    ("r_a_fraction", _config(r=8.5), "adapter_config.json", ["r=8.5 is not allowed"]),
    ("r_true", _config(r=True), "adapter_config.json", ["r=True is not allowed"]),
    ("r_zero", _config(r=0), "adapter_config.json", ["r=0 is not allowed"]),
    # torch's allocator's traceback
    ("r_huge", _config(r=10**12), "adapter_config.json",
     [f"r=1000000000000 is not allowed; it must be an integer in 1 .. {SMALLEST_SIDE} (the smallest side"]),
    ("r_missing", _config(r="DELETE"), "adapter_config.json", ["r is missing"]),
    ("alpha_a_string", _config(lora_alpha="x"), "adapter_config.json",
     ["lora_alpha='x' is not allowed; it must be a finite number"]),
    ("alpha_missing", _config(lora_alpha="DELETE"), "adapter_config.json", ["lora_alpha is missing"]),
    ("dropout_one", _config(lora_dropout=1), "adapter_config.json", ["lora_dropout=1 is not allowed", "[0, 1)"]),
    ("targets_a_number", _config(target_modules=5), "adapter_config.json",
     [f"target_modules=5 is not allowed; it must be a {TARGETS}"]),
    ("targets_unknown", _config(target_modules=["q_proj", "qproj"]), "adapter_config.json",
     ["target_modules=['q_proj', 'qproj'] is not allowed", "('qproj': it matches no module of the model)"]),
    # the LM head is tied to the embedding: merging into it changed the embedding too
    ("targets_the_head", _config(target_modules=["lm_head"]), "adapter_config.json",
     ["('lm_head': it matches 'lm_head', not one of those)"]),
    ("targets_a_block", _config(target_modules=["mlp"]), "adapter_config.json",
     ["('mlp': it matches 'model.layers.0.mlp', not one of those)"]),
    ("targets_bad_regex", _config(target_modules="("), "adapter_config.json", ["target_modules='(' is not allowed"]),
    # options our loading does not carry out: DoRA loaded silently without its magnitude weights
    ("dora", _config(use_dora=True), "adapter_config.json", [f"use_dora=True {LEFT_OFF}"]),
    ("modules_to_save", _config(modules_to_save=["lm_head"]), "adapter_config.json",
     [f"modules_to_save=['lm_head'] {LEFT_OFF}"]),
    ("layers_to_transform_a_string", _config(layers_to_transform="x"), "adapter_config.json",
     [f"layers_to_transform='x' {LEFT_OFF}"]),
    ("layers_to_transform_zero", _config(layers_to_transform=0), "adapter_config.json",
     [f"layers_to_transform=0 {LEFT_OFF}"]),
    ("rank_pattern", _config(rank_pattern={"q_proj": 2}), "adapter_config.json", ["rank_pattern={'q_proj': 2}"]),
    ("an_unknown_option", _config(new_option=3), "adapter_config.json", [f"new_option=3 {LEFT_OFF}"]),
    # PiSSA rewrites the base weights while it loads
    ("init_pissa", _config(init_lora_weights="pissa"), "adapter_config.json",
     ["init_lora_weights='pissa' is not allowed; it must be true, false or 'gaussian'"]),
    ("bias_all", _config(bias="all"), "adapter_config.json", ["bias='all' is not allowed; it must be 'none'"]),
    # a SafetensorError traceback; a missing file was Hugging Face's "Repo id must be ..." message
    ("weights_empty", _weights_bytes(lambda data: b""), "adapter_model.safetensors",
     ["is not a readable safetensors file (Error while deserializing header"]),
    ("weights_truncated", _weights_bytes(lambda data: data[:len(data) // 2]), "adapter_model.safetensors",
     ["is not a readable safetensors file"]),
    ("weights_missing", _no_weights, ".", ["no adapter_model.safetensors there"]),
    ("rank_not_the_weights", _config(r=2), "adapter_model.safetensors",
     [f"{DOWN_A_KEY} has shape [{RANK}, 192]", "adapter_config.json's r=2 and target_modules imply", "is [2, 192]"]),
    ("a_tensor_missing", _weights(lambda tensors: tensors.pop(B_KEY)), "adapter_model.safetensors",
     [f"lacks {B_KEY}, what adapter_config.json's r={RANK} and target_modules imply"]),
    ("a_tensor_too_many", _weights(lambda tensors: tensors.update(extra=torch.zeros(2))), "adapter_model.safetensors",
     ["holds extra, not what adapter_config.json's"]),
    ("targets_fewer_than_the_weights", _config(target_modules=["q_proj"]), "adapter_model.safetensors",
     [f"holds {DOWN_A_KEY} and 23 more, not what"]),  # 2 layers x 6 projections x A, B
    ("a_nan_weight", _weights(lambda tensors: tensors[A_KEY].__setitem__((0, 0), float("nan"))),
     "adapter_model.safetensors", [f"its weight {A_KEY} holds 1 NaN or infinite value"]),
]


@pytest.mark.parametrize(("edit", "file", "named"), [case[1:] for case in BAD_ADAPTERS],
                         ids=[case[0] for case in BAD_ADAPTERS])
def test_a_bad_adapter_is_refused_in_one_line_naming_the_file(adapter, tmp_path, edit, file, named) -> None:
    base, lora = adapter
    broken = tmp_path / "lora"
    shutil.copytree(lora, broken)
    edit(broken)
    with pytest.raises(ValueError) as info:
        load_model(base, device="cpu", lora=broken)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and str(broken / file) in message, message
    assert all(part in message for part in named), message


@pytest.mark.parametrize("tool", ["chat", "evaluate"])
def test_the_tools_exit_with_the_one_line(adapter, tmp_path, capsys, tool) -> None:
    """No traceback: the refusal is the tool's last line on stderr, and it exits 2 (evaluate printed loss nan with
    a NaN lora_alpha and exited 0; chat gave a traceback)."""
    from eval.chat import main as chat_main
    from eval.evaluate import main as evaluate_main

    base, lora = adapter
    broken = tmp_path / "lora"
    shutil.copytree(lora, broken)
    _config(use_dora=True)(broken)
    data = tmp_path / "text.jsonl"
    data.write_text(json.dumps({"text": "The river runs to the sea."}) + "\n")
    if tool == "chat":
        code = chat_main(["--model_path", str(base), "--lora", str(broken), "--prompt", "Hi", "--no_tools"])
    else:
        code = evaluate_main(["--model_path", str(base), "--lora", str(broken), "--data", str(data),
                              "--device", "cpu", "--no_samples"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and error[-1] == (f"error: {broken / 'adapter_config.json'}: use_dora=True {LEFT_OFF} (left "
                                       f"off)"), error
    assert not any("Traceback" in line for line in error)


def test_a_broken_config_is_named_where_the_base_model_is_read_from_it(adapter, tmp_path) -> None:
    """Without --model_path the base model is read from adapter_config.json: a file that is not JSON was "names no
    base model; pass it with --model_path", which would not have helped."""
    _, lora = adapter
    broken = tmp_path / "lora"
    shutil.copytree(lora, broken)
    _config_bytes(b"{")(broken)
    with pytest.raises(ModelNotFound, match=r"adapter_config.json is not valid JSON \(Expecting property name"):
        locate_model_and_adapter(None, broken)
    assert locate_model_and_adapter(None, lora)[:2] == (adapter[0], lora)


def test_a_sound_adapter_loads_to_the_logits_peft_gives(adapter) -> None:
    """The checks change nothing for an adapter they pass: load_model's logits are bit for bit those of PEFT's own
    loading and merge of the same directory (what load_model did before them), and the adapter changes them."""
    from peft import PeftModel

    base, lora = adapter
    model, _ = load_model(base, device="cpu", dtype="float32", lora=lora)
    plain = load_strictly(base, dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(load_strictly(base, dtype=torch.float32), str(lora)).merge_and_unload()
    with torch.no_grad():
        logits, expected = model(input_ids=IDS).logits, reference.eval()(input_ids=IDS).logits
        assert torch.equal(logits, expected)
        assert (logits - plain(input_ids=IDS).logits).abs().max() > 1e-3
