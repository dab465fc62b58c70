"""Loading a trained model directory for inference (chat, evaluation, export, the server): ours, or any causal-LM
directory transformers knows, such as the Llama directories scripts/convert_to_llama.py writes, optionally with a
LoRA adapter on top (model/lora.py). Finding the directory, and naming the command that creates a missing one, is
trainer/run_dir.py's job."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.integrations.hub_kernels import is_kernel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging as hf_logging

from dataset.atomic_io import first_line, not_utf8
from dataset.json_text import JsonTextError, json_file_value, read_json
from dataset.shown_value import shown_value
from dataset.tokenization import check_tokenizer_files, load_tokenizer, not_a_json_object
from model.generation_defaults import floats_where_floats_go, read_generation_config
from model.weight_checks import (check_finite, check_weight_dtypes, few, in_two_shards, layers_held, safetensors_shapes,
                                 unreadable_safetensors)

# Importing any module of the `model` package runs model/__init__.py, which registers the "mininorm" type with
# transformers' Auto classes: AutoModelForCausalLM below loads our directories.


def _json_object(file: Path) -> dict[str, Any] | None:
    """A config file's fields read as plain JSON (no config class); None when it is missing, unreadable or no JSON
    object (AutoConfig then names what is wrong with it)."""
    fields = json_file_value(file)
    return fields if isinstance(fields, dict) else None


def _plain_fields(file: Path) -> dict[str, Any]:
    """_json_object's fields, {} where it has none."""
    return _json_object(file) or {}


def config_model_type(path: Path) -> str | None:
    """model_type in path/config.json, read as plain JSON (no config class); None when missing or unreadable."""
    return _plain_fields(path / "config.json").get("model_type")


INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor name -> shard file


def weights_file(path: Path) -> Path:
    """The file a model directory's weights are read from (the shard index when sharded), for messages."""
    for name in ("model.safetensors", INDEX_FILE, "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    return path / "model.safetensors"


def index_shards(folder: Path) -> list[Path]:
    """The shard files the INDEX_FILE of `folder` names; a ValueError naming the index when it is not a JSON object
    with a weight_map (tensor name -> shard file), or names a shard that is missing or not a file in `folder`. Both
    the loader (load_strictly) and the import (model/interop.py) read an index through here: transformers read
    `{"weight_map": []}` as an AttributeError traceback, and a missing shard or metadata as `KeyError: 'metadata'`."""
    index = folder / INDEX_FILE
    try:
        # strictly: a tensor named twice in the weight_map is in the shard of whichever entry a reader keeps
        fields = read_json(index.read_bytes())
    except OSError as error:
        raise ValueError(f"{index.name} is not a JSON object ({error})") from None
    except JsonTextError as error:
        raise ValueError(error.about(index.name) if error.problem.startswith("has a duplicate key")
                         else f"{index.name} is not a JSON object ({error})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{index.name} is not a JSON object")
    weight_map = fields.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index.name} has no weight_map (tensor name -> shard file)")
    files = set()
    for name in weight_map.values():
        # A shard is a file in the checkpoint folder, by its name: a name like ../../etc/passwd is not read. The
        # entry itself may be a link (the Hugging Face hub cache links each file of a snapshot to a blob).
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{index.name} names the shard {shown_value(name)}, which is not a file in that folder")
        file = folder / name
        if not file.is_file():
            raise ValueError(f"{index.name} names the shard {name}, which is missing")
        files.add(file)
    if not isinstance(fields.get("metadata"), dict):  # transformers reads it unchecked: `KeyError: 'metadata'`
        raise ValueError(f"{index.name} has no metadata (an object, {{}} at least), which transformers reads")
    return sorted(files)


def saved_shapes(path: Path) -> dict[str, list[int]]:
    """Every tensor's shape as the safetensors headers of model directory `path` give them (no tensor is read);
    empty for a directory without safetensors weights. A bad shard index is a ValueError (index_shards), and so is a
    tensor that is no float weight in a checkpoint that is not quantized (check_weight_dtypes: integers, float8)."""
    file = weights_file(path)
    if file.name == INDEX_FILE:
        shards = index_shards(path)
    else:
        shards = [file] if file.name == "model.safetensors" and file.is_file() else []
    shapes: dict[str, list[int]] = {}
    holders: dict[str, Path] = {}
    # a quantized checkpoint's tensors (int8, uint8, float8) are read with their scales by transformers' quantizer
    quantized = "quantization_config" in _plain_fields(path / "config.json")
    for shard in shards:
        try:
            found = safetensors_shapes(shard)
        except ValueError:
            return {}  # from_pretrained names the unreadable file
        if not quantized:  # from_pretrained casts them to the model's dtype, silently wrong
            check_weight_dtypes(shard, f"cannot load {path}")
        for key in found:
            if key in holders:
                raise ValueError(f"cannot load {path}: {in_two_shards(key, holders[key], shard)}")
            holders[key] = shard
        shapes.update(found)
    return shapes


def _shapes_config_gives(path: Path, model_class: Any, overrides: dict[str, Any]) -> list[str]:
    """The saved tensors whose shape is not the one config.json (with `overrides`, as from_pretrained takes them)
    gives their parameter, from a model built on the meta device: compared before from_pretrained, which allocates
    a mismatched parameter at config.json's size (vocab_size=10**12 was an allocator's traceback)."""
    saved = saved_shapes(path)
    if not saved:
        return []
    config = AutoConfig.from_pretrained(path, **{key: value for key, value in overrides.items() if key != "dtype"})
    # Layers the weights lack are named before the meta model is built: one of num_hidden_layers=10**9 took hours
    # to build (its modules, one by one). A file whose keys name no layers (another layout) is left to the comparison.
    held = layers_held(saved)
    if held and getattr(config, "num_hidden_layers", 0) > held:
        raise ValueError(f"cannot load {path}: its config.json gives num_hidden_layers={config.num_hidden_layers}, "
                         f"but the weights in {weights_file(path).name} hold {held} layers")
    with torch.device("meta"):
        model = model_class.from_config(config) if hasattr(model_class, "from_config") else model_class(config)
    expected = model.state_dict()
    return [_other_shape(key, shape, expected[key].shape)
            for key, shape in saved.items() if key in expected and list(expected[key].shape) != list(shape)]


def _other_shape(key: str, saved: Any, wanted: Any) -> str:
    return f"{key} ({list(saved)} in the file, {list(wanted)} by config.json)"


# The weights' precision that config.json's dtype (torch_dtype in older files) names, as transformers reads it: the
# name of a torch attribute, which it looks up unchecked (`"bf16"` was an AttributeError traceback, `"nn"` a module).
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _check_dtype_fields(file: Path) -> None:
    """A ValueError naming `file` and the field when its dtype or torch_dtype is not null or a float dtype's name;
    a file that is no JSON object is left to AutoConfig, which names what is wrong with it."""
    fields = _plain_fields(file)
    for key in ("dtype", "torch_dtype"):
        value = fields.get(key)
        if value is not None and value not in FLOAT_DTYPES:
            raise ValueError(f"{file}: {key}={shown_value(value)} is not allowed; it must be null or one of "
                             f"{', '.join(map(repr, FLOAT_DTYPES))}")


# transformers' names of a nested text config (PretrainedConfig.get_text_config). A config whose model type has none
# keeps a value there as a plain field, which get_text_config then returns as the model's own config: `"text_config":
# "x"` was an AttributeError traceback ('str' object has no attribute 'to_dict') once the model was built.
NESTED_TEXT_CONFIGS = ("text_config", "decoder", "generator", "text_encoder")

# How a config.json's size fields end (hidden_size, num_attention_heads, num_hidden_layers, head_dim): one of 0 is
# named when transformers' config class divided by it.
SIZE_SUFFIXES = ("_size", "_heads", "_layers", "head_dim")


# What a config.json's model_type names, in a refusal: ours, and the two architectures the project exports and imports.
MODEL_TYPE_EXAMPLES = "'mininorm', 'llama' or 'qwen3'"


def load_config(path: Path) -> PretrainedConfig:
    """path/config.json as its config class; ValueError naming the file when it is not valid JSON, not an object, or
    holds a value the class refuses (transformers' own fields included: a dtype, an id2label of the wrong kind, a
    nested text config where its model type has none)."""
    file = path / "config.json"
    _check_dtype_fields(file)
    fields = _json_object(file)
    if fields is not None and "model_type" not in fields:  # AutoConfig's words: "Unrecognized model in <folder>"
        raise ValueError(f"{file}: has no model_type; it must name the model's architecture (such as "
                         f"{MODEL_TYPE_EXAMPLES})")
    try:
        config = AutoConfig.from_pretrained(path)
    # AttributeError: PretrainedConfig reads its generic fields unchecked (`"id2label": "x"`: 'str' object has no
    # attribute 'items'; `"quantization_config": "x"`: no attribute 'to_dict')
    # RecursionError: json's, for arrays nested past the recursion limit
    except (OSError, TypeError, ValueError, KeyError, AttributeError, RecursionError) as error:
        raise ValueError(f"{file}: {first_line(error)}") from None
    # transformers' own config classes (LlamaConfig, Qwen3Config) validate as strict dataclasses, whose error is no
    # ValueError and words its cause on a second line (hidden_size 30 over 4 heads, a layer_types of another length
    # than num_hidden_layers, a pretraining_tp of 1.0); LlamaConfig divides by num_attention_heads=0 unchecked.
    except StrictDataclassError as error:
        raise ValueError(f"{file}: {first_line(error.__cause__ or error)}") from None
    except ZeroDivisionError:
        zeros = [key for key, value in _plain_fields(file).items() if value == 0 and key.endswith(SIZE_SUFFIXES)]
        raise ValueError(f"{file}: {', '.join(f'{key}=0' for key in zeros) or 'a size of 0'} is not allowed; "
                         "it must be a positive integer") from None
    _check_attention(file, config)
    for key in NESTED_TEXT_CONFIGS:
        value = getattr(config, key, None)
        if value is not None and not isinstance(value, PretrainedConfig):
            raise ValueError(f"{file}: {key}={shown_value(value)} is not allowed; it must be null or absent (a "
                             f"{config.model_type} model has no nested text config)")
    return config


def attention_choices(config: PretrainedConfig) -> list[str]:
    """The attention implementations a model of `config` takes by name, as transformers' check lists them
    (get_correct_attn_implementation): "eager", "paged|eager", and each registered one its causal-LM class supports
    (MiniNorm: none, its attention is its own)."""
    mapping = AutoModelForCausalLM._model_mapping
    model_class = mapping[type(config)] if type(config) in mapping else None
    supports = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}

    def supported(name: str) -> bool:
        flag = "_supports_flash_attn" if name.startswith("flash_attention") else supports.get(name)
        return model_class is None or flag is None or bool(getattr(model_class, flag, False))
    return ["eager", *(name for name in ALL_ATTENTION_FUNCTIONS.valid_keys() if supported(name))]


def _check_attention(file: Path, config: PretrainedConfig) -> None:
    """A ValueError naming `file`, the field and the allowed values where config.json's _attn_implementation (or
    attn_implementation) is not null, one of attention_choices or a hub kernel ("org/name"): transformers refused it
    when the model was built, in words that name no file ("bogus": 'Specified `attn_implementation="bogus"` is not
    supported', "sdpa" on MiniNorm a line with a link to an issue; 5: an AttributeError traceback)."""
    value = getattr(config, "_attn_implementation", None)
    choices = attention_choices(config)
    if value is None or (isinstance(value, str) and (value.removeprefix("paged|") in choices or is_kernel(value))):
        return
    field = next((key for key in ("_attn_implementation", "attn_implementation") if key in _plain_fields(file)),
                 "_attn_implementation")
    raise ValueError(f"{file}: {field}={shown_value(value)} is not allowed; it must be null, one of "
                     f"{', '.join(map(repr, choices))} (for a {config.model_type} model) or a hub kernel ('org/name')")


# The config.json fields that make transformers import a package to build or load the model.
PACKAGE_FIELDS = ("quantization_config", "_attn_implementation", "attn_implementation")
NEEDS_NO_PACKAGE = (None, "eager", "sdpa", "paged|eager")  # values of those fields that torch alone computes


def missing_package(path: Path, error: ImportError) -> str:
    """The one line for an ImportError transformers raised building or loading the model of directory `path`: the
    config.json field that asked for the package (a quantization_config's bitsandbytes, an _attn_implementation's
    flash-attn or hub kernel), where it has one, and transformers' own first line."""
    fields = _plain_fields(path / "config.json")
    field = next((name for name in PACKAGE_FIELDS if fields.get(name) not in NEEDS_NO_PACKAGE), None)
    needs = (f"its config.json's {field} needs what is not installed" if field is not None
             else "a package it needs is missing")
    return f"cannot load {path}: {needs} ({first_line(error)})"


def load_strictly(path: Path, model_class: Any = AutoModelForCausalLM, allowed_missing: Collection[str] = (),
                  **kwargs: Any) -> PreTrainedModel:
    """`model_class.from_pretrained(path, **kwargs)`, refusing every weight that is missing (but those named in
    `allowed_missing`, new on purpose), unexpected or of another shape, and an LM head that config.json says is
    tied but the file holds separately.

    transformers only logs those and initialises the missing weights at random: a damaged file, or a config.json
    that disagrees with it (num_hidden_layers, qk_norm, num_experts, tie_word_embeddings), would load, run and
    export as a different model. Every load of a model directory -- for inference, export, or a training run's
    starting weights, teacher, critic and reward model -- goes through here.
    """
    config = load_config(path)  # a bad config.json or generation_config.json is named before any weight is read
    read_generation_config(path, getattr(config, "vocab_size", None))
    # A config its class has no model for: an Auto class refused it with its list of every class it has (a line of
    # ~2,000 characters under another: --reward_model at a causal LM, which has no sequence-classification head),
    # and a model class was built on it and failed on a field it lacks (--from_weight at a Llama directory: an
    # AttributeError traceback, 'LlamaConfig' object has no attribute 'dropout').
    supported, own = getattr(model_class, "_model_mapping", None), getattr(model_class, "config_class", None)
    if supported is not None and type(config) not in supported:
        raise ValueError(f"cannot load {path}: its config.json's model_type {config.model_type!r} has no "
                         f"{model_class.__name__} in transformers")
    if supported is None and own is not None and not isinstance(config, own):
        raise ValueError(f"cannot load {path}: its config.json's model_type {config.model_type!r} is not "
                         f"{model_class.__name__}'s ({own.model_type!r})")
    file = weights_file(path)
    if file.name == INDEX_FILE:  # a bad index is named before transformers reads it
        try:
            index_shards(path)
        except ValueError as error:
            raise ValueError(f"cannot load {path}: {error}") from None
    try:
        shapes = _shapes_config_gives(path, model_class, kwargs)
    except ImportError as error:  # the model's build asked for a package: an _attn_implementation's hub kernel
        raise ValueError(missing_package(path, error)) from None
    if shapes:
        raise ValueError(f"cannot load {path}: the weights in {file} do not match its config.json: of another "
                         f"shape {few(shapes, shown=1)}")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its table of missing keys would precede our one-line refusal
    try:
        model, info = model_class.from_pretrained(path, output_loading_info=True, ignore_mismatched_sizes=True,
                                                  **kwargs)
    except SafetensorError as error:
        raise ValueError(unreadable_safetensors(file, error)) from None
    except OSError as error:  # a shard the index names is missing, no weights file at all, ...
        raise ValueError(f"cannot load {path}: {first_line(error)}") from None
    except ImportError as error:  # a config.json's quantization_config names a package not installed (bitsandbytes)
        raise ValueError(missing_package(path, error)) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    problems = []
    missing = set(info["missing_keys"]) - set(allowed_missing)
    if missing:
        problems.append(f"missing {few(missing)}")
    if info["unexpected_keys"]:
        problems.append(f"unexpected {few(info['unexpected_keys'])}")
    if info["mismatched_keys"]:
        shapes = {_other_shape(key, saved, wanted) for key, saved, wanted in info["mismatched_keys"]}
        problems.append(f"of another shape {few(shapes, shown=1)}")
    if problems:
        raise ValueError(f"cannot load {path}: the weights in {file} do not match its config.json: "
                         f"{'; '.join(problems)}")
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and head is not None and head.weight is not embeddings.weight:
        raise ValueError(f"cannot load {path}: config.json says tie_word_embeddings=true but {file} holds its own "
                         f"lm_head.weight, which differs from the embedding")
    check_finite(model.named_parameters(), f"cannot load {path}")
    if getattr(model, "generation_config", None) is not None:  # its generate() would refuse a temperature of 2
        floats_where_floats_go(model.generation_config)
    return model


def load_dir_tokenizer(path: Path) -> Any:
    """The tokenizer saved in the model directory `path`; ValueError naming the folder and its tokenizer files when
    they are missing or damaged, or a save stopped while it moved them in (check_tokenizer_files)."""
    check_tokenizer_files(path)
    try:
        tokenizer = load_tokenizer(path)
    except Exception as error:  # noqa: BLE001 -- transformers and tokenizers raise any kind on a damaged file
        missing = [name for name in ("tokenizer.json", "tokenizer_config.json") if not (path / name).is_file()]
        what = f"no {' or '.join(missing)} there" if missing else f"tokenizer.json / tokenizer_config.json: " \
                                                                   f"{first_line(error)}"
        # valid JSON of another kind: transformers' words ('list' object has no attribute 'get') name no file
        what = next((f"{name} {problem}" for name in ("tokenizer.json", "tokenizer_config.json")
                     if (problem := not_a_json_object(path / name))), what)
        if isinstance(error, UnicodeDecodeError):  # the decoder's words name no file: a chat_template.jinja too
            what = next((f"{name}: {problem}" for name in ("tokenizer.json", "tokenizer_config.json",
                                                            "chat_template.jinja")
                         if (problem := _not_utf8_file(path / name))), what)
        raise ValueError(f"cannot read the tokenizer of {path}: {what}") from None
    if tokenizer.eos_token_id is None:  # generation could not stop, packing could not separate documents
        why = ("its tokenizer_config.json names none (eos_token)" if (path / "tokenizer_config.json").is_file()
               else "no tokenizer_config.json there (the file that names it)")
        raise ValueError(f"the tokenizer of {path} has no eos token: {why}")
    check_special_tokens_known(path, tokenizer)
    return tokenizer


def _not_utf8_file(file: Path) -> str | None:
    """not_utf8's words for `file` when it is a file whose bytes are not UTF-8, else None."""
    try:
        file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        return not_utf8(error)
    except OSError:
        return None
    return None


def check_special_tokens_known(path: Path, tokenizer: Any) -> None:
    """A ValueError naming tokenizer_config.json and the field where it names a special token (eos_token, ...)
    that tokenizer.json does not hold: transformers adds it as a new token, at an id the model never trained (an
    eos the model never writes: generation would not stop), or one past its vocab_size (refused as a tokenizer too
    big for the model, which named the wrong cause)."""
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(path / "tokenizer.json"))
    for field, token in tokenizer.special_tokens_map.items():
        if isinstance(token, str) and saved.token_to_id(token) is None:
            raise ValueError(f"{path / 'tokenizer_config.json'}: {field}={shown_value(token)} is not a token of its "
                             f"tokenizer.json; name one that file holds")


def check_tokenizer_fits(tokenizer: Any, vocab_size: int, path: Path) -> None:
    """A ValueError naming the folder where its tokenizer has ids the model has no embedding for (more tokens than
    config.json's vocab_size): such an id fails in the embedding lookup, and llama.cpp would tokenize otherwise."""
    if len(tokenizer) > vocab_size:
        raise ValueError(f"{path}: its tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size="
                         f"{vocab_size} (config.json): ids from {vocab_size} on have no embedding; give the model "
                         f"the tokenizer it was trained with")


def pick_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(path: Path, device: str = "auto", dtype: str = "auto", lora: Path | None = None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a model directory, with the LoRA adapter directory `lora` merged into
    its weights when given (the adapter's own base model is `path`).

    dtype "auto": bfloat16 on CUDA, float32 elsewhere. The saved norm_impl is kept, except that a saved "auto"
    becomes "eager" on CPU: torch.compile's start-up costs more than it saves in a chat. The adapter is merged in
    fp32, before the cast to `dtype`.
    """
    hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with chat output
    device = pick_device(device)
    torch_dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
                   "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    overrides: dict[str, Any] = {}
    config = load_config(path)
    if getattr(config, "norm_impl", None) == "auto" and not device.startswith("cuda"):
        overrides["norm_impl"] = "eager"
    if lora is None:
        loaded = load_strictly(path, dtype=torch_dtype, **overrides)
    else:
        from model.lora import load_adapter

        base = load_strictly(path, dtype=torch.float32, **overrides)
        loaded = load_adapter(base, lora, merge=True).to(torch_dtype)
    tokenizer = load_dir_tokenizer(path)
    check_tokenizer_fits(tokenizer, loaded.config.vocab_size, path)
    return loaded.to(device).eval(), tokenizer
