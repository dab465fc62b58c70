"""GenerationSettings.logprobs (model/generation.py): each generated token's log-probability under the model's raw
distribution at its step, and the most likely tokens of that distribution. The reference is a cache-free forward of
the whole finished sequence (prompt and generated ids) in float64, log_softmax at each position: what the model
says, whatever the sampler's temperature, penalties, top-k or top-p made of it."""

from __future__ import annotations

import pytest
import torch

from dataset.tokenization import token_bytes
from model.generation import GenerationEngine, GenerationSettings, _StepLogprobs
from tests.unit.test_generation import NEVER, PROMPTS, plain_ids, run_until_done

TOLERANCE = 1e-4  # float32 logits through a KV cache against a float64 forward without one


def reference_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """(len(generated), vocab): the log-probabilities the model gave before each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]


def assert_matches_the_reference(model, generation, top: int) -> None:
    expected = reference_logprobs(model, generation.prompt_ids, generation.token_ids)
    assert len(generation.logprobs) == len(generation.token_ids) > 0
    for step, (token, entry) in enumerate(zip(generation.token_ids, generation.logprobs)):
        assert entry.logprob == pytest.approx(expected[step, token].item(), abs=TOLERANCE)
        values, ids = expected[step].topk(top)
        assert [i for i, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))  # most likely first
        if entry.top and token == entry.top[0][0]:
            assert entry.logprob == entry.top[0][1]


@pytest.mark.parametrize("decode", ["forward", "static"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0),
                                      dict(temperature=1.4, top_p=0.8, top_k=30, repetition_penalty=1.3, seed=5),
                                      dict(temperature=0.7, frequency_penalty=1.5, presence_penalty=-1.0, seed=2)])
def test_logprobs_are_the_raw_distribution_of_each_step(pretrained, decode, sampling) -> None:
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER], decode=decode)
    for top in (0, 5):
        generation = engine.generate(plain_ids(tokenizer, PROMPTS[1]),
                                     GenerationSettings(max_new_tokens=12, logprobs=top, **sampling))
        assert_matches_the_reference(model, generation, top)


@pytest.mark.parametrize("decode", ["forward", "static"])
def test_rows_with_and_without_logprobs_decode_batched(pretrained, decode) -> None:
    """Rows that ask for logprobs (with different counts) and rows that do not join a running batch at different
    times and leave at different times: each asking row matches the reference, the others record none, and every
    row generates what it generates alone."""
    model, tokenizer = pretrained
    counts, budgets = (None, 3, 0, None, 20), (9, 14, 5, 16, 11)
    settings = [GenerationSettings(max_new_tokens=budget, temperature=0.9, seed=index, logprobs=count)
                for index, (count, budget) in enumerate(zip(counts, budgets))]
    prompts = [plain_ids(tokenizer, text) for text in PROMPTS]
    engine = GenerationEngine(model, tokenizer, max_batch=3, eos_token_ids=[NEVER], decode=decode)
    generations = []
    for index, (prompt, setting) in enumerate(zip(prompts, settings)):
        generations.append(engine.submit(prompt, setting))
        if index % 2:
            engine.step()
    assert max(run_until_done(engine, *generations)) == 3
    alone = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER], decode=decode)
    for generation, count in zip(generations, counts):
        assert generation.token_ids == alone.generate(generation.prompt_ids, generation.settings).token_ids
        if count is None:
            assert generation.logprobs == []
        else:
            assert_matches_the_reference(model, generation, count)


def test_a_batch_that_asks_for_none_computes_none(pretrained, monkeypatch) -> None:
    """The log-probabilities cost nothing to requests that do not ask: no step computes them."""
    model, tokenizer = pretrained
    made = []
    original = _StepLogprobs.__init__
    monkeypatch.setattr(_StepLogprobs, "__init__", lambda self, *args: made.append(args) or original(self, *args))
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER])
    plain = [engine.submit(plain_ids(tokenizer, text), GenerationSettings(max_new_tokens=6)) for text in PROMPTS[:2]]
    run_until_done(engine, *plain)
    assert made == []
    asking = engine.submit(plain_ids(tokenizer, PROMPTS[2]), GenerationSettings(max_new_tokens=6, logprobs=1))
    run_until_done(engine, asking)
    assert len(made) == 6 and len(asking.logprobs) == 6  # the prefill's, then one per decode step


def test_logprobs_beyond_the_vocabulary_are_refused(pretrained) -> None:
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer)
    for count in (-1, len(tokenizer) + 1):
        with pytest.raises(ValueError, match=rf"^logprobs must be None or 0 to {len(tokenizer)} .*got {count}$"):
            engine.submit([1, 2], GenerationSettings(logprobs=count))


@pytest.mark.parametrize("text", ["北京是中华人民共和国的首都", "naïve café ☕ 😀", "plain words"])
def test_token_bytes_are_each_token_s_own_bytes(tokenizer, text) -> None:
    """Joined, the tokens' bytes are the text's UTF-8, though a token may hold part of a character only; a control
    token's bytes are its text's."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = token_bytes(tokenizer, ids)
    assert b"".join(pieces) == text.encode("utf-8") and len(pieces) == len(ids)
    assert token_bytes(tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")]) == [b"<|im_end|>"]


def test_token_bytes_of_a_sentencepiece_style_tokenizer(sentencepiece_tokenizer) -> None:
    """Llama-style pieces (an imported checkpoint's tokenizer): "▁" is a space and a byte-fallback token "<0xE4>" its
    one byte, so the tokens' bytes joined are the text's UTF-8 (with the space the word mark puts before it)."""
    sentencepiece = sentencepiece_tokenizer
    text = "a café 北京 a"
    ids = sentencepiece(text, add_special_tokens=False)["input_ids"]
    pieces = token_bytes(sentencepiece, ids)
    assert {b"\xc3", b"\xa9", b" ca"} <= set(pieces)  # byte-fallback tokens and a word-initial piece
    assert b"".join(pieces) == f" {text}".encode("utf-8") and len(pieces) == len(ids)
    assert token_bytes(sentencepiece, [2]) == [b"</s>"]
