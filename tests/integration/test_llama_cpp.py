"""Stock llama.cpp loads our GGUF files and computes what our model computes: the same token ids and token bytes,
the same logits, the same greedy tokens, a chat completion through the embedded template, and tool conversations
rendered by that template to the token ids transformers' apply_chat_template gives on the Llama export (and
MiniNorm's encode_chatml). llama.cpp is driven through its Python binding, llama-cpp-python, built from the
llama.cpp source it ships (requirements-dev.txt)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import copy
import ctypes
import json
import shutil

import llama_cpp

import numpy as np
import pytest
import torch
from llama_cpp import GGML_TYPE_F32, Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from transformers import AutoTokenizer

from dataset.chat_format import CHATML_TEMPLATE, encode_chatml
from model.chat_session import ChatSession, GenerationSettings
from model.loading import load_model
from scripts.convert_to_gguf import convert_to_gguf
from scripts.convert_to_llama import convert_to_llama
from tests.tool_conversations import CONVERSATIONS, LOOK_ALIKE_CONVERSATION, RENDERINGS, conversation

TEXTS = {"english": "The history of the city begins with a small fishing village.",
         "chinese": "北京是中华人民共和国的首都，也是政治和文化中心。",
         "emoji": "I love pizza 🍕🙂👍🏽 and  two  spaces\n\nnew line",
         "numbers": "In 1969, 3.14159 and 1234567 people paid $42.50",
         "chatml": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"}


@pytest.fixture(scope="module")
def ggufs(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_cpp")
    return {(name, outtype): convert_to_gguf(getattr(tiny_models, name), root / f"{name}-{outtype}.gguf", outtype)
            for name in ("sft", "pretrain") for outtype in ("f32", "f16")}


@contextmanager
def _llama(path) -> Iterator[Llama]:
    """llama.cpp on one GGUF file. Its KV cache is f16 by default (logits then differ by ~2e-3); f32 keeps the
    comparison about the file."""
    llm = Llama(model_path=str(path), n_ctx=128, n_threads=1, logits_all=True, seed=0, verbose=False,
                type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    try:
        yield llm
    finally:
        llm.close()


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte is spelled as one printable character (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[chr(byte)] = byte
        else:
            spelled[chr(256 + extra)] = byte
            extra += 1
    return spelled


@pytest.mark.parametrize("name", TEXTS)
def test_token_ids_equal_ours(ggufs, tokenizer, name) -> None:
    text = TEXTS[name]
    with _llama(ggufs["sft", "f16"]) as llm:
        # add_bos=True asks for the special tokens the file says to add (it says none, like our tokenizer)
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == tokenizer(text)["input_ids"]


def test_every_token_is_the_same_bytes(ggufs, tokenizer) -> None:
    decoder, specials = _byte_decoder(), set(tokenizer.all_special_ids)
    with _llama(ggufs["sft", "f16"]) as llm:
        for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
            ours = token.encode() if token_id in specials else bytes(decoder[char] for char in token)
            assert llm.detokenize([token_id], special=True) == ours, (token_id, token)
        assert (llm.token_eos(), llm.n_vocab()) == (tokenizer.eos_token_id, len(tokenizer))


# An f16 file: llama.cpp rounds the activations and the KV cache to f16 as well as the weights, and how it rounds
# depends on the CPU its build targets. Measured against our fp32 logits (-7.6 to 13.9) on an AMD EPYC: mean 0.0015,
# 99.99th percentile 0.031, max 0.126 at one position (rounding the weights alone: max 0.030); the largest stays far
# from what a wrong tensor gives (off everywhere), and the mean bound catches a small error that is everywhere.
@pytest.mark.parametrize("name,outtype,atol,mean_atol", [("pretrain", "f32", 1e-4, 1e-4), ("sft", "f32", 1e-4, 1e-4),
                                                         ("sft", "f16", 0.25, 5e-3)])
def test_logits_equal_ours(tiny_models, ggufs, tokenizer, name, outtype, atol, mean_atol) -> None:
    ours, _ = load_model(getattr(tiny_models, name), device="cpu", dtype="float32")
    ids = tokenizer(TEXTS["chatml"] + TEXTS["chinese"])["input_ids"]
    with torch.no_grad():
        expected = ours(torch.tensor([ids])).logits[0].numpy()
    with _llama(ggufs[name, outtype]) as llm:
        llm.eval(ids)
        got = np.array(llm.scores[:len(ids)])
    assert np.abs(got - expected).max() < atol and np.abs(got - expected).mean() < mean_atol
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("name,outtype", [("pretrain", "f32"), ("sft", "f32"), ("sft", "f16")])
def test_greedy_tokens_equal_ours(tiny_models, ggufs, tokenizer, name, outtype) -> None:
    ours, _ = load_model(getattr(tiny_models, name), device="cpu", dtype="float32")
    prompt = tokenizer(TEXTS["chatml"])["input_ids"]
    with torch.no_grad():
        expected = ours.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    expected = expected[0, len(prompt):].tolist()
    got = []
    with _llama(ggufs[name, outtype]) as llm:
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # llama.cpp's own greedy sampler
            got.append(token)
            if token == tokenizer.eos_token_id or len(got) == 24:
                break
    assert got == expected
    if name == "sft":  # the tiny SFT model answers with its one sentence, then <|im_end|>
        assert tokenizer.decode(got, skip_special_tokens=True) == tiny_models.reply and got[-1] == 2


def test_chat_completion_through_the_embedded_template(tiny_models, ggufs, tokenizer) -> None:
    model, _ = load_model(tiny_models.sft, device="cpu", dtype="float32")
    session = ChatSession(model, tokenizer, use_template=True, system_prompt="Be brief.",
                          settings=GenerationSettings(temperature=0.0, max_new_tokens=60))
    ours = session.reply("Who are you?")
    with _llama(ggufs["sft", "f16"]) as llm:  # the binding renders the GGUF's tokenizer.chat_template
        answer = llm.create_chat_completion([{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Who are you?"}],
                                            temperature=0.0, max_tokens=60)
    # The tiny model never saw a system prompt, so its answer is odd (it stutters before its sentence, stopping
    # after 36 tokens); what matters is that it is the same answer.
    assert answer["choices"][0]["message"]["content"] == ours.text and len(ours.text) > 10
    assert answer["choices"][0]["finish_reason"] == "stop" and ours.stopped_at_eos  # at <|im_end|>
    assert answer["usage"]["completion_tokens"] == ours.new_tokens - 1  # the binding leaves out the <|im_end|>
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Who are you?"}],
                                             tokenize=False, add_generation_prompt=True)
    assert answer["usage"]["prompt_tokens"] == len(tokenizer(rendered)["input_ids"])


# ------------------------------------------------------------------ tool conversations through the exported template
@pytest.fixture(scope="module")
def llama_export(tiny_models, tmp_path_factory):
    """The SFT model as a Llama directory, and that directory as a GGUF (what a llama.cpp user converts)."""
    root = tmp_path_factory.mktemp("llama_export")
    export = convert_to_llama(tiny_models.sft, root / "llama")
    return export, convert_to_gguf(export, root / "llama-f16.gguf", "f16")


@contextmanager
def _vocabulary(path) -> Iterator[Llama]:
    """llama.cpp with the file's vocabulary and metadata only (no weights): its tokenizer and chat template."""
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        yield llm
    finally:
        llm.close()


def _formatter(llm: Llama, add_generation_prompt: bool) -> Jinja2ChatFormatter:
    """The chat formatter llama-cpp-python builds from a GGUF's tokenizer.chat_template (Llama.__init__ does this
    for its chat_template.default handler, always with add_generation_prompt=True)."""
    return Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"],
                               eos_token=llm._model.token_get_text(llm.token_eos()),
                               bos_token=llm._model.token_get_text(llm.token_bos()),
                               add_generation_prompt=add_generation_prompt, stop_token_ids=[llm.token_eos()])


def _llama_cpp_ids(llm: Llama, messages, tools, add_generation_prompt: bool = False, **template_kwargs) -> list[int]:
    """What llama-cpp-python's chat handler feeds the model: the template's text, tokenized with special tokens
    parsed (chat_formatter_to_chat_completion_handler)."""
    result = _formatter(llm, add_generation_prompt)(messages=messages, tools=tools, **template_kwargs)
    return llm.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)


def test_the_exports_carry_the_template(llama_export, ggufs) -> None:
    export, export_gguf = llama_export
    assert json.loads((export / "tokenizer_config.json").read_text())["chat_template"] == CHATML_TEMPLATE
    assert (export / "chat_template.jinja").read_text(encoding="utf-8") == CHATML_TEMPLATE
    assert AutoTokenizer.from_pretrained(export).chat_template == CHATML_TEMPLATE
    for path in (export_gguf, ggufs["sft", "f16"]):
        with _vocabulary(path) as llm:
            assert llm.metadata["tokenizer.chat_template"] == CHATML_TEMPLATE
            assert llm.chat_format == "chat_template.default"  # the embedded template, not a guessed built-in one


def test_a_reader_of_tokenizer_config_json_gets_the_template(llama_export, tmp_path, tokenizer) -> None:
    """Readers before transformers 5 know tokenizer_config.json's chat_template, not chat_template.jinja."""
    older = shutil.copytree(llama_export[0], tmp_path / "older")
    (older / "chat_template.jinja").unlink()
    messages, tools = conversation("multi_round")
    ours = encode_chatml(tokenizer, messages, tools=tools).input_ids
    messages, tools = conversation("multi_round")
    theirs = AutoTokenizer.from_pretrained(older).apply_chat_template(messages, tools=tools, tokenize=True)
    assert theirs["input_ids"] == ours


@pytest.mark.parametrize("rendering", RENDERINGS)
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_tool_conversation_ids_equal_transformers(llama_export, tokenizer, name, rendering) -> None:
    """llama.cpp renders each tool conversation with the GGUF's template (tools, tool role turns, OpenAI's and
    MiniMind's tool_calls, reasoning_content, open_thinking passed as a template variable) and tokenizes it to the
    ids stock transformers gets from the Llama export -- which are MiniNorm's own."""
    export, export_gguf = llama_export
    kwargs = RENDERINGS[rendering]
    messages, tools = conversation(name)
    theirs = AutoTokenizer.from_pretrained(export).apply_chat_template(messages, tools=tools, tokenize=True,
                                                                       **kwargs)["input_ids"]
    messages, tools = conversation(name)
    assert theirs == encode_chatml(tokenizer, messages, tools=tools, **kwargs).input_ids
    messages, tools = conversation(name)
    with _vocabulary(export_gguf) as llm:
        assert _llama_cpp_ids(llm, messages, tools, **kwargs) == theirs


def test_create_chat_completion_sends_the_same_prompt_ids(llama_export, tokenizer) -> None:
    """The whole binding path: create_chat_completion with OpenAI's tools and a tool round in the messages. It
    takes no template variables, so open_thinking stays off (the prompt injects the empty think block)."""
    messages, tools = conversation("openai_string_arguments")
    expected = encode_chatml(tokenizer, messages, tools=tools, add_generation_prompt=True).input_ids
    # n_ctx beyond the tiny model's 128 positions: only the prompt's ids matter here.
    llm = Llama(model_path=str(llama_export[1]), n_ctx=512, n_threads=1, seed=0, verbose=False)
    try:
        answer = llm.create_chat_completion(copy.deepcopy(messages), tools=tools, temperature=0.0, max_tokens=1)
        assert answer["usage"]["prompt_tokens"] == len(expected)
        assert llm.input_ids[:len(expected)].tolist() == expected
    finally:
        llm.close()


def test_look_alike_tags_are_parsed_as_transformers_parses_them(llama_export, tokenizer) -> None:
    """A "<tool_call>" typed in a user message or returned by a tool: both stock renderers tokenize the
    template's text with special tokens parsed, so both make it the control token, and agree with each other;
    MiniNorm's encode_chatml (training, chat, the server) keeps it text (tests/unit/test_template_interop.py)."""
    export, export_gguf = llama_export
    kwargs = {"add_generation_prompt": True}
    theirs = AutoTokenizer.from_pretrained(export).apply_chat_template(
        copy.deepcopy(LOOK_ALIKE_CONVERSATION), tokenize=True, **kwargs)["input_ids"]
    with _vocabulary(export_gguf) as llm:
        assert _llama_cpp_ids(llm, copy.deepcopy(LOOK_ALIKE_CONVERSATION), None, **kwargs) == theirs
        # Tokenized with special-token parsing off, llama.cpp keeps the tags as text, as encode_chatml does.
        assert llm.tokenize(b"<tool_call>", add_bos=False, special=False) == tokenizer(
            "<tool_call>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert theirs != encode_chatml(tokenizer, LOOK_ALIKE_CONVERSATION, **kwargs).input_ids


def test_the_c_api_renders_its_builtin_chatml_instead(llama_export) -> None:
    """llama.cpp's C API (llama_chat_apply_template: programs that do not run the template's Jinja) recognises
    ChatML by <|im_start|> and renders its built-in ChatML: the prompt lacks the empty think block MiniNorm's
    template injects, and tools have no place. docs/gguf.md says so."""
    with _vocabulary(llama_export[1]) as llm:
        template = llm.metadata["tokenizer.chat_template"].encode()
    chat = (llama_cpp.llama_chat_message * 1)(llama_cpp.llama_chat_message(role=b"user", content=b"Hi"))
    buffer = ctypes.create_string_buffer(1024)
    written = llama_cpp.llama_chat_apply_template(template, chat, 1, True, buffer, len(buffer))
    assert buffer.value.decode()[:written] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
