"""model/generation.py: the decode loop chat, evaluation and the server share. References: transformers'
generate() (greedy and seeded sampling, token for token), a cache-free full forward of each finished sequence
(the logits every batched step saw), and the tokenizer's decode of all ids (the streamed text)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.chat_session import encode_prompt
from model.config import MiniNormConfig
from model.generation import (FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, GenerationEngine,
                              GenerationSettings, TextStream, _Row, default_eos_token_ids, logit_bias_row)
from model.model import MiniNormForCausalLM
from tests.unit.test_model import randomize

PROMPTS = ("The history of", "Water is a chemical compound of hydrogen and", "北京是", "A",
           "A tiny language model learns to continue text one token at a time, and then")
NEVER = -1  # an eos id no model emits: generations run to their budget


def run_until_done(engine: GenerationEngine, *generations, max_steps: int = 2000) -> list[int]:
    """Step the engine (on this thread) until the generations are done; the batch size after each step. Bounded,
    so a broken engine fails the test instead of hanging it."""
    sizes = []
    for _ in range(max_steps):
        if all(g.done for g in generations):
            return sizes
        engine.step()
        sizes.append(engine.load[0])
    raise AssertionError(f"not done after {max_steps} steps")


def plain_ids(tokenizer, text: str) -> list[int]:
    return encode_prompt(tokenizer, [{"role": "user", "content": text}], use_template=False)


def hf_generate(model, ids: list[int], seed: int | None = None, **kwargs) -> list[int]:
    if seed is not None:
        torch.manual_seed(seed)
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("which", ["sft", "pretrained"])
def test_greedy_equals_transformers_generate(which, request) -> None:
    model, tokenizer = request.getfixturevalue(which)
    engine = GenerationEngine(model, tokenizer, max_batch=1)
    for text in PROMPTS:
        ids = (encode_prompt(tokenizer, [{"role": "user", "content": text}], use_template=True) if which == "sft"
               else plain_ids(tokenizer, text))
        generation = engine.generate(ids, GenerationSettings(max_new_tokens=24, temperature=0.0))
        expected = hf_generate(model, ids, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        assert generation.token_ids == expected
        assert generation.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert generation.finish_reason == (FINISH_STOP if expected[-1] == tokenizer.eos_token_id else FINISH_LENGTH)


@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_p=0.9, top_k=0, repetition_penalty=1.0),
                                      dict(temperature=1.3, top_p=0.7, top_k=40, repetition_penalty=1.2)])
def test_seeded_sampling_equals_transformers_generate(pretrained, sampling) -> None:
    """With the same seed our per-request generator draws what generate() draws from the global one, through
    the same processors: temperature, top-k, top-p and the repetition penalty."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=1)
    for seed, text in enumerate(PROMPTS[:3]):
        ids = plain_ids(tokenizer, text)
        ours = engine.generate(ids, GenerationSettings(max_new_tokens=30, seed=seed, **sampling)).token_ids
        theirs = hf_generate(model, ids, seed=seed, max_new_tokens=30, do_sample=True,
                             eos_token_id=tokenizer.eos_token_id, **sampling)
        assert ours == theirs


def openai_penalised_greedy(model, prompt: list[int], budget: int, frequency: float, presence: float,
                            bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding under OpenAI's penalties and logit_bias, from a cache-free float64 forward of the sequence
    at every step."""
    reference: list[int] = []
    for _ in range(budget):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + reference])).logits[0, -1].double()
        for token, value in (bias or {}).items():
            logits[token] += value
        counts = torch.bincount(torch.tensor(reference, dtype=torch.long), minlength=logits.numel()).double()
        reference.append(int((logits - frequency * counts - presence * (counts > 0).double()).argmax()))
    return reference


@pytest.mark.parametrize("penalties", [dict(presence_penalty=-2.0), dict(frequency_penalty=0.7),
                                       dict(presence_penalty=1.5, frequency_penalty=-1.0)])
def test_greedy_with_presence_and_frequency_penalties_follows_openais_formula(pretrained, penalties) -> None:
    """OpenAI's penalties as its documentation writes them: each logit minus frequency_penalty times the token's
    count in the completion so far, minus presence_penalty if that count is above zero; the prompt's tokens are not
    counted. The reference applies them to a cache-free float64 forward of the sequence so far."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER])
    budget, changed = 24, 0
    for text in PROMPTS[:3]:
        ids = plain_ids(tokenizer, text)
        ours = engine.generate(ids, GenerationSettings(max_new_tokens=budget, temperature=0.0, **penalties))
        reference = openai_penalised_greedy(model, ids, budget, penalties.get("frequency_penalty", 0.0),
                                            penalties.get("presence_penalty", 0.0))
        assert ours.token_ids == reference
        plain = engine.generate(ids, GenerationSettings(max_new_tokens=budget, temperature=0.0)).token_ids
        changed += plain != reference
    assert changed  # the penalties made a difference the reference agrees with


def test_penalised_rows_decode_batched_with_plain_and_sampled_rows(pretrained, monkeypatch) -> None:
    """OpenAI's penalties are applied to the whole batch at once, from counts kept beside the KV cache: rows with
    different penalties (and rows without, greedy and sampled) join a running batch at different times and leave at
    different times. Each greedy row follows the float64 reference of its own penalties; the sampled penalised row
    draws what it draws alone; and a greedy row never goes through its sampler after its first token."""
    model, tokenizer = pretrained
    sampled_calls: dict[int, int] = {}
    original = _Row.sample

    def counting_sample(self, scores):
        sampled_calls[id(self.generation)] = sampled_calls.get(id(self.generation), 0) + 1
        return original(self, scores)

    monkeypatch.setattr(_Row, "sample", counting_sample)
    penalties = [(0.7, 0.0), (0.0, 0.0), (-1.0, 1.5), (0.0, -2.0), (0.25, 0.0)]
    budgets = (14, 5, 20, 9, 12)
    sampled = GenerationSettings(max_new_tokens=16, temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3,
                                 seed=7)
    engine = GenerationEngine(model, tokenizer, max_batch=3, eos_token_ids=[NEVER])
    prompts = [plain_ids(tokenizer, text) for text in PROMPTS]
    generations = []
    for index, (prompt, (frequency, presence), budget) in enumerate(zip(prompts, penalties, budgets)):
        settings = GenerationSettings(max_new_tokens=budget, temperature=0.0, frequency_penalty=frequency,
                                      presence_penalty=presence)
        generations.append(engine.submit(prompt, settings))
        if index == 1:
            generations.append(engine.submit(prompts[0], sampled))
        if index % 2:
            engine.step()  # the next prompt joins a batch already decoding
    sizes = run_until_done(engine, *generations)
    assert max(sizes) == 3 and engine.batched_rows > engine.steps  # it really ran batched
    greedy = [g for g in generations if g.settings is not sampled]
    for generation, prompt, (frequency, presence), budget in zip(greedy, prompts, penalties, budgets):
        assert generation.token_ids == openai_penalised_greedy(model, prompt, budget, frequency, presence)
        assert sampled_calls[id(generation)] == 1  # its first token, at the prefill; the rest batched
    alone = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER]).generate(prompts[0], sampled)
    assert generations[2].token_ids == alone.token_ids and len(alone.token_ids) == 16
    assert engine._penalties is None and engine.load == (0, 0)


def test_a_logit_bias_follows_openais_definition_alone_and_batched(pretrained) -> None:
    """OpenAI's logit_bias: each named token's logit plus its value at every step, the first token's included,
    before the penalties' turn; -100 bans a token. Rows with and without a bias (and with penalties) share a batch,
    each following the float64 reference of its own settings; the log-probabilities stay the model's own."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER])
    prompt, budget = plain_ids(tokenizer, PROMPTS[1]), 12
    plain = engine.generate(prompt, GenerationSettings(max_new_tokens=budget, temperature=0.0, logprobs=1))
    banned = dict.fromkeys(plain.token_ids[:3], -100.0)
    favoured = {plain.token_ids[5]: 4.0}
    cases = [(banned, 0.0), ({**banned, **favoured}, 0.3), ({}, 0.2), (favoured, 0.0)]
    batched = GenerationEngine(model, tokenizer, max_batch=4, eos_token_ids=[NEVER])
    generations = [batched.submit(prompt, GenerationSettings(max_new_tokens=budget, temperature=0.0, logprobs=1,
                                                             logit_bias=bias or None, frequency_penalty=frequency))
                   for bias, frequency in cases]
    run_until_done(batched, *generations)
    for generation, (bias, frequency) in zip(generations, cases):
        assert generation.token_ids == openai_penalised_greedy(model, prompt, budget, frequency, 0.0, bias)
        alone = engine.generate(prompt, generation.settings)
        assert alone.token_ids == generation.token_ids
    assert not set(banned) & set(generations[0].token_ids) and generations[0].token_ids != plain.token_ids
    assert generations[3].token_ids[0] == plain.token_ids[5]  # +4 moved the first token
    # the model's own distribution: the banned token still tops the biased run's first entry, as in the plain run
    (top_token, top_logprob), = generations[0].logprobs[0].top
    assert top_token == plain.token_ids[0] and top_logprob == pytest.approx(plain.logprobs[0].logprob, abs=1e-4)


@pytest.mark.parametrize("bias, message", [({10**6: 1.0}, "logit_bias names token 1000000; token ids are 0 to "),
                                           ({-1: 1.0}, "logit_bias names token -1; token ids are 0 to "),
                                           ({5: float("nan")}, "logit_bias of token 5 is nan, not a finite number")])
def test_a_logit_bias_outside_the_vocabulary_fails_only_its_request(pretrained, bias, message) -> None:
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER])
    ids = plain_ids(tokenizer, PROMPTS[0])
    bad = engine.submit(ids, GenerationSettings(max_new_tokens=4, temperature=0.0, logit_bias=bias))
    good = engine.submit(ids, GenerationSettings(max_new_tokens=4, temperature=0.0))
    run_until_done(engine, bad, good)
    assert bad.finish_reason == FINISH_ERROR and bad.error.startswith(message)
    assert good.finish_reason == FINISH_LENGTH and len(good.token_ids) == 4


class _CudaDeviceRule(TorchDispatchMode):
    """CUDA's rule for an indexed write, which a CPU run does not enforce: the values must be on the written
    tensor's device (a 0-d tensor excepted); a CPU tensor of values into a GPU tensor is a RuntimeError there."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
            written, _, values = args[:3]
            if values.device != written.device and values.dim() > 0:
                raise RuntimeError(f"values on {values.device}, written tensor on {written.device}")
        return func(*args, **(kwargs or {}))


def test_a_logit_bias_row_is_built_on_the_engines_device() -> None:
    """The row's values went to the device as a CPU tensor: on a GPU every request with a logit_bias failed at its
    first token (a 500 from the server). Checked here on the meta device under CUDA's rule."""
    settings = GenerationSettings(logit_bias={1: 2.0, 3: -1.5})
    with _CudaDeviceRule():
        row = logit_bias_row(settings, 8, torch.device("meta"))
    assert row.device.type == "meta" and row.shape == (8,)
    assert logit_bias_row(settings, 8, torch.device("cpu")).tolist() == [0, 2.0, 0, -1.5, 0, 0, 0, 0]


def full_forward_argmax(model, ids: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([ids])).logits[0, -1].double().argmax())


def test_a_greedy_span_is_decoded_greedily_and_the_rest_sampled(pretrained) -> None:
    """GenerationSettings.greedy_span (a tool call's JSON in chat): from its open token through its close token a
    sampled row takes the top token of a cache-free float64 forward; before it, it draws what it draws without the
    span (same seed); after the close it draws again. A prompt that ends inside the span starts greedily."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER])
    prompt = plain_ids(tokenizer, PROMPTS[0])
    sampled = GenerationSettings(max_new_tokens=30, temperature=1.0, top_p=1.0, seed=3)
    free = engine.generate(prompt, sampled).token_ids
    opening = free[2]

    def top_tokens(prefix: list[int], tokens: list[int]) -> list[int]:  # the top token before each of `tokens`
        return [full_forward_argmax(model, prefix + tokens[:i]) for i in range(len(tokens))]

    never_closed = engine.generate(prompt, replace(sampled, greedy_span=(opening, NEVER))).token_ids
    assert never_closed[:3] == free[:3]  # drawn as without the span, the open token included
    assert never_closed[3:] == top_tokens(prompt, never_closed)[3:]  # then greedy to the end
    assert free[3:] != never_closed[3:]  # which the draws were not
    closing = never_closed[3]  # the span's first token closes it: the draws resume after it
    closed = engine.generate(prompt, replace(sampled, greedy_span=(opening, closing))).token_ids
    assert closed[:4] == never_closed[:4]
    assert sum(a != b for a, b in zip(closed[4:], top_tokens(prompt, closed)[4:])) > 5  # drawn again
    started = engine.generate(prompt + [opening], replace(sampled, greedy_span=(opening, NEVER))).token_ids
    assert started == top_tokens(prompt + [opening], started)


def test_batched_rows_see_the_logits_of_a_full_forward(pretrained, monkeypatch) -> None:
    """Rows join a running batch at different times with different prompt lengths (left-padded caches) and leave
    at different times; every logit vector a row sampled from equals a cache-free forward of its sequence."""
    assert_rows_see_a_full_forward(*pretrained, monkeypatch)


def test_a_model_with_smeared_keys_decodes_batched_rows_exactly(tokenizer, monkeypatch) -> None:
    """The same with smeared keys (a key mixes in the previous position's; the engine leaves the static decode step
    for the forward): each new token mixes with its row's last key, in caches left-padded to a common length."""
    torch.manual_seed(0)
    config = MiniNormConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, norm_impl="eager", smeared_keys=True)
    model = randomize(MiniNormForCausalLM(config)).eval()
    assert_rows_see_a_full_forward(model, tokenizer, monkeypatch)


def assert_rows_see_a_full_forward(model, tokenizer, monkeypatch) -> None:
    seen: dict[int, list[torch.Tensor]] = {}
    original = _Row.sample

    def recording_sample(self, logits):
        seen.setdefault(id(self.generation), []).append(logits.clone())
        return original(self, logits)

    monkeypatch.setattr(_Row, "sample", recording_sample)
    engine = GenerationEngine(model, tokenizer, max_batch=3, eos_token_ids=[NEVER])
    budgets = (9, 4, 12, 6, 7)
    generations = []
    for index, (text, budget) in enumerate(zip(PROMPTS, budgets)):
        settings = GenerationSettings(max_new_tokens=budget, temperature=0.9, seed=index)
        generations.append(engine.submit(plain_ids(tokenizer, text), settings))
        if index % 2:
            engine.step()  # the next prompt joins a batch already decoding
    batch_sizes = run_until_done(engine, *generations)
    assert max(batch_sizes) == 3 and engine.batched_rows > engine.steps  # it really ran batched
    for generation, budget in zip(generations, budgets):
        assert generation.finish_reason == FINISH_LENGTH and len(generation.token_ids) == budget
        full = torch.tensor([generation.prompt_ids + generation.token_ids[:-1]])
        with torch.no_grad():
            reference = model(input_ids=full).logits[0, len(generation.prompt_ids) - 1:].float()
        torch.testing.assert_close(torch.stack(seen[id(generation)]), reference, atol=1e-5, rtol=1e-5)


def test_batched_greedy_answers_equal_single_answers(sft) -> None:
    model, tokenizer = sft
    questions = ("Hi!", "Who are you?", "What is the capital of France?", "你好")
    settings = GenerationSettings(max_new_tokens=30, temperature=0.0)
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q}], use_template=True) for q in questions]
    single = [GenerationEngine(model, tokenizer, max_batch=1).generate(ids, settings).token_ids for ids in prompts]
    engine = GenerationEngine(model, tokenizer, max_batch=4)
    engine.start()
    try:
        generations = [engine.submit(ids, settings) for ids in prompts]
        assert all(g.wait(60) for g in generations)
    finally:
        engine.close()
    assert [g.token_ids for g in generations] == single
    assert all(g.text == "I am a tiny model." and g.finish_reason == FINISH_STOP for g in generations)


def test_a_cancelled_request_frees_its_slot(pretrained) -> None:
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER])
    long = engine.submit(plain_ids(tokenizer, "The history of"), GenerationSettings(max_new_tokens=100))
    waiting = engine.submit(plain_ids(tokenizer, "Water is"), GenerationSettings(max_new_tokens=5))
    for _ in range(3):
        engine.step()
    assert engine.load == (1, 1) and len(long.token_ids) == 4 and not waiting.token_ids  # the only slot is taken
    long.cancel()  # e.g. its client disconnected
    run_until_done(engine, waiting)
    assert long.finish_reason == FINISH_CANCELLED and len(long.token_ids) == 4
    assert waiting.finish_reason == FINISH_LENGTH and len(waiting.token_ids) == 5


def test_the_engine_thread_serves_and_closes(pretrained) -> None:
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER])
    engine.start()
    pieces: list[str] = []
    done = threading.Event()
    generation = engine.submit(plain_ids(tokenizer, "The history of"), GenerationSettings(max_new_tokens=6),
                               on_text=pieces.append, on_finish=lambda g: done.set())
    assert done.wait(60) and generation.finish_reason == FINISH_LENGTH and "".join(pieces) == generation.text
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1], GenerationSettings())


def test_a_failing_callback_or_step_fails_only_its_requests(pretrained, monkeypatch) -> None:
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER])

    def broken(piece: str) -> None:
        raise ConnectionError("client went away")

    bad = engine.submit(plain_ids(tokenizer, "The history of"), GenerationSettings(max_new_tokens=50),
                        on_text=broken)
    good = engine.submit(plain_ids(tokenizer, "Water is"), GenerationSettings(max_new_tokens=8))
    run_until_done(engine, good)
    assert bad.finish_reason == FINISH_CANCELLED and good.finish_reason == FINISH_LENGTH

    calls = {"n": 0}
    forward = type(model).forward

    def failing_once(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("out of memory")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", failing_once)
    first = engine.submit(plain_ids(tokenizer, "A"), GenerationSettings(max_new_tokens=20))
    run_until_done(engine, first)
    assert first.finish_reason == FINISH_ERROR and "out of memory" in first.error
    after = engine.generate(plain_ids(tokenizer, "A"), GenerationSettings(max_new_tokens=4))
    assert after.finish_reason == FINISH_LENGTH and len(after.token_ids) == 4


def test_a_failure_while_joining_ends_every_request_it_touches(pretrained, monkeypatch) -> None:
    """The joining request and the batch it joins end with an error (the batch's cache is suspect); none is lost
    waiting forever, and the engine serves the next request."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER])
    running = engine.submit(plain_ids(tokenizer, "The history of"), GenerationSettings(max_new_tokens=50))
    engine.step()
    monkeypatch.setattr(GenerationEngine, "_join", lambda *args: (_ for _ in ()).throw(RuntimeError("bad cache")))
    joining = engine.submit(plain_ids(tokenizer, "Water is"), GenerationSettings(max_new_tokens=50))
    run_until_done(engine, running, joining)
    assert running.finish_reason == joining.finish_reason == FINISH_ERROR and "bad cache" in joining.error
    monkeypatch.undo()
    after = engine.generate(plain_ids(tokenizer, "A"), GenerationSettings(max_new_tokens=4))
    assert after.finish_reason == FINISH_LENGTH and engine.load == (0, 0)


def test_the_context_limit_ends_a_generation(pretrained) -> None:
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER])
    ids = plain_ids(tokenizer, "The history of")
    generation = engine.generate(ids, GenerationSettings(max_new_tokens=10_000, temperature=0.0))
    assert generation.finish_reason == FINISH_LENGTH
    assert len(ids) + len(generation.token_ids) == model.config.max_position_embeddings


def test_stop_when_ends_a_generation_where_it_says_and_sees_each_prefix(pretrained) -> None:
    """GenerationSettings.stop_when: the server's stop strings of a reply's content (a thought's or a call's text
    holds none); the generation ends as at a stop string, right after the token it fires on."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER])
    seen: list[list[int]] = []

    def after_four(ids: list[int], text: str) -> bool:
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        seen.append(list(ids))
        return len(ids) >= 4

    generation = engine.generate(plain_ids(tokenizer, "The history of"),
                                 GenerationSettings(max_new_tokens=50, temperature=0.0, stop_when=after_four))
    assert generation.finish_reason == FINISH_STOP and len(generation.token_ids) == 4
    assert seen[-1] == generation.token_ids and all(ids == generation.token_ids[:len(ids)] for ids in seen)


# ------------------------------------------------------------------------------------------------ TextStream
TEXTS = ("Hello, world! 你好，世界。 Emoji 🤖🎉👨‍👩‍👧 done.", "The end. STOP here", "a\n\nb  c")


@pytest.mark.parametrize("text", TEXTS)
def test_stream_pieces_add_up_to_the_decoded_text(tokenizer, text) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    stream = TextStream(tokenizer)
    pieces = [stream.push(token) for token in ids] + [stream.finish()]
    assert "".join(pieces) == stream.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in pieces)  # no character is ever cut in two


def test_a_sentencepiece_stream_keeps_the_spaces_between_words(sentencepiece_tokenizer) -> None:
    """An imported Llama's tokenizer strips the first word mark of what it decodes: each piece decoded alone lost
    its space ("aca北café" for "a ca 北 café"). The pieces add up to decoding every id at once, characters spelled
    in byte-fallback tokens whole."""
    text = "a ca 北 café fa 京 a"
    ids = sentencepiece_tokenizer(text, add_special_tokens=False)["input_ids"] + [sentencepiece_tokenizer.eos_token_id]
    stream = TextStream(sentencepiece_tokenizer)
    pieces = [stream.push(token) for token in ids] + [stream.finish()]
    assert "".join(pieces) == stream.text == text == sentencepiece_tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("character, stray", [("𝍁", 0xEA), ("é", 0x80)])
def test_a_sentencepiece_stream_shows_a_stray_byte_after_a_shown_character_once(sentencepiece_tokenizer, character,
                                                                               stray) -> None:
    """A model may follow a character spelled in byte-fallback tokens with a byte that is no UTF-8 (a lone lead or
    continuation byte). The character was shown when its last byte came; the stray byte turns the whole byte run
    into U+FFFDs for a SentencePiece decoder, a text the stream cannot take back. What the later ids add is then
    their own text: one U+FFFD for the one byte, then the words with their spaces -- not the whole run's U+FFFDs
    cut at the shown text's length (a character's count off for every byte but one the shown character had)."""
    sentencepiece = sentencepiece_tokenizer
    byte_ids = [sentencepiece.convert_tokens_to_ids(f"<0x{byte:02X}>") for byte in (*character.encode(), stray)]
    words = sentencepiece.convert_tokens_to_ids(["▁c", "▁a", "a", "c", "▁ca"])
    stream = TextStream(sentencepiece)
    pieces = [stream.push(token) for token in [sentencepiece.convert_tokens_to_ids("▁a"), *byte_ids, *words]]
    pieces.append(stream.finish())
    assert character in pieces  # shown whole, once its bytes were complete
    assert "".join(pieces) == stream.text == f"a{character}\ufffd c aac ca"


def test_stream_stops_before_a_stop_string_and_holds_back_its_start(tokenizer) -> None:
    text = "The end. STOP here and more"
    stream = TextStream(tokenizer, stop=("STOP", "never"))
    shown = ""
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        shown += stream.push(token)
        assert "S" not in shown  # "S", "ST", "STO" could still become "STOP": held back
        if stream.stopped:
            break
    shown += stream.finish()
    assert stream.stopped and shown == stream.text == "The end. "
    # A held-back start that never becomes a stop string is shown at the end.
    stream = TextStream(tokenizer, stop=("STOPPED",))
    pieces = [stream.push(t) for t in tokenizer("go STOP", add_special_tokens=False)["input_ids"]]
    assert "".join(pieces) == "go " and stream.finish() == "STOP" and not stream.stopped


def test_a_sentencepiece_stream_of_random_pieces_equals_decoding_them_all(sentencepiece_tokenizer) -> None:
    """Random word pieces, marked or not, and characters of one to four bytes spelled in byte-fallback tokens: the
    pieces add up to decoding every id at once. (A run of byte tokens that is not UTF-8 is replaced as a whole by
    such a decoder, so only whole characters are drawn.)"""
    sentencepiece = sentencepiece_tokenizer
    words = [sentencepiece.convert_tokens_to_ids(piece) for piece in ("▁", "a", "c", "f", "▁a", "▁c", "▁ca", "北")]
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids: list[int] = []
        for _ in range(40):
            if torch.rand((), generator=generator) < 0.6:
                ids.append(words[int(torch.randint(len(words), (), generator=generator))])
            else:
                character = chr(int(torch.randint(0x80, 0x1F600, (), generator=generator)))
                if 0xD800 <= ord(character) < 0xE000:  # a surrogate is no character
                    character = "é"
                ids += [sentencepiece.convert_tokens_to_ids(f"<0x{byte:02X}>") for byte in character.encode()]
        stream = TextStream(sentencepiece)
        pieces = [stream.push(token) for token in ids] + [stream.finish()]
        assert "".join(pieces) == sentencepiece.decode(ids, skip_special_tokens=True)


def test_stream_of_random_tokens_equals_decoding_them_all(tokenizer) -> None:
    """Random ids make broken UTF-8 (lone continuation bytes, cut characters): the pieces still add up to what
    decoding all ids at once gives, U+FFFD included, whatever the order of the breaks."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(3, len(tokenizer), (60,), generator=generator).tolist()
        stream = TextStream(tokenizer)
        pieces = [stream.push(token) for token in ids] + [stream.finish()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_top_k_of_one_keeps_only_the_top_token_as_transformers_does() -> None:
    """top_k=1 is transformers' TopKLogitsWarper(1): only the most likely token can be drawn (0 is "off"), whatever
    the temperature and top_p."""
    from transformers import TopKLogitsWarper

    scores = torch.tensor([[0.5, 3.0, 2.9, -1.0]])
    settings = GenerationSettings(temperature=1.7, top_k=1, top_p=1.0)
    out = scores.clone()
    for processor in settings.processors():
        out = processor(torch.zeros((1, 1), dtype=torch.long), out)
    reference = TopKLogitsWarper(1)(None, scores / 1.7)
    assert torch.isfinite(out).tolist() == [[False, True, False, False]] and torch.equal(out, reference)
    assert not any(isinstance(p, TopKLogitsWarper) for p in replace(settings, top_k=0).processors())


def test_a_logit_bias_of_the_first_id_past_the_vocabulary_is_refused() -> None:
    from model.generation import SamplingError, check_logit_bias

    check_logit_bias({0: 1.0, 7: -100}, 8)
    with pytest.raises(SamplingError, match=r"^logit_bias names token 8; token ids are 0 to 7$"):
        check_logit_bias({8: 1.0}, 8)


def test_a_refused_logit_bias_quotes_its_token_and_value_on_one_short_line() -> None:
    """A library caller's logit_bias may hold a tensor (the server's JSON cannot): its repr is every element over
    many lines, so the refusal quotes it as dataset/shown_value.py does, by type, shape and dtype."""
    from model.generation import SamplingError, check_logit_bias

    with pytest.raises(SamplingError) as refused:
        check_logit_bias({3: torch.ones(20, 20)}, 8)
    assert str(refused.value) == ("logit_bias of token 3 is <Tensor of shape (20, 20), torch.float32>, not a finite "
                                  "number")
    with pytest.raises(SamplingError) as refused:
        check_logit_bias({torch.arange(30): 1.0}, 8)
    assert str(refused.value) == ("logit_bias names token <Tensor of shape (30,), torch.int64>; token ids are 0 to "
                                  "7")


def test_an_empty_stop_string_stops_nothing(tokenizer) -> None:
    ids = tokenizer("no stop here", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, stop=("",))
    shown = "".join(stream.push(token) for token in ids) + stream.finish()
    assert shown == "no stop here" and not stream.stopped


def test_a_prompt_ends_inside_a_greedy_span_only_after_an_unclosed_open() -> None:
    """A prompt that opened a span (a tool call's JSON) and did not close it starts the completion greedily; one
    whose last span token closes it, or that has none, starts sampled."""
    from model.generation import _ends_inside

    opening, closing = 5, 6
    assert _ends_inside([1, opening, 9, 9], opening, closing)
    assert not _ends_inside([1, opening, 9, closing, 9], opening, closing)
    assert _ends_inside([opening, closing, 2, opening], opening, closing)
    assert not _ends_inside([1, 2, 3], opening, closing) and not _ends_inside([], opening, closing)


def test_the_engine_stops_at_the_tokenizers_and_the_generation_configs_eos_unless_given_its_own(tokenizer) -> None:
    """default_eos_token_ids: the tokenizer's eos and the generation config's (a list, one id, or none); an engine
    given eos_token_ids stops at those alone (mutants that dropped the config's ids, or ignored the given ones,
    survived the generation tests)."""
    model = MiniNormForCausalLM(MiniNormConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, norm_impl="eager"))
    eos = tokenizer.eos_token_id
    for configured, expected in (([3, 4], {eos, 3, 4}), (5, {eos, 5}), (None, {eos})):
        model.generation_config.eos_token_id = configured
        assert default_eos_token_ids(model, tokenizer) == frozenset(expected)
    model.generation_config.eos_token_id = [3]
    assert GenerationEngine(model, tokenizer, max_batch=1).eos_token_ids == frozenset({eos, 3})
    assert GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER]).eos_token_ids == frozenset({NEVER})
