"""Stock llama.cpp loads our GGUF files and computes what our model computes: the same token ids and token bytes,
the same logits, the same greedy tokens, and a chat completion through the embedded template. llama.cpp is driven
through its Python binding, llama-cpp-python, built from the llama.cpp source it ships (requirements-dev.txt)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from llama_cpp import GGML_TYPE_F32, Llama

from model.chat_session import ChatSession, GenerationSettings
from model.loading import load_model
from scripts.convert_to_gguf import convert_to_gguf

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


@pytest.mark.parametrize("name,outtype,atol", [("pretrain", "f32", 1e-4), ("sft", "f32", 1e-4), ("sft", "f16", 5e-2)])
def test_logits_equal_ours(tiny_models, ggufs, tokenizer, name, outtype, atol) -> None:
    ours, _ = load_model(getattr(tiny_models, name), device="cpu", dtype="float32")
    ids = tokenizer(TEXTS["chatml"] + TEXTS["chinese"])["input_ids"]
    with torch.no_grad():
        expected = ours(torch.tensor([ids])).logits[0].numpy()
    with _llama(ggufs[name, outtype]) as llm:
        llm.eval(ids)
        got = np.array(llm.scores[:len(ids)])
    assert np.abs(got - expected).max() < atol
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
