"""model/generation.py: one request's error is that request's alone. A seed torch cannot take, or sampling
settings whose scores turn NaN or infinite, end that request (finish reason "error") and nothing else: the other
rows of the batch run to the end they have alone, and no request is left unfinished."""

from __future__ import annotations

import pytest

from model.chat_session import encode_prompt
from model.generation import FINISH_ERROR, FINISH_LENGTH, NON_FINITE_SCORES, GenerationEngine, GenerationSettings

pytestmark = pytest.mark.usefixtures("one_thread")

NEVER = -1  # an eos id no model emits: generations run to their budget
GREEDY = GenerationSettings(max_new_tokens=12, temperature=0.0)


def run_until_done(engine: GenerationEngine, *generations, max_steps: int = 300) -> None:
    """Step the engine on this thread until the generations are done; bounded, so a request the engine lost fails
    the test instead of hanging it."""
    for _ in range(max_steps):
        if all(g.done for g in generations):
            return
        engine.step()
    lost = [g.settings for g in generations if not g.done]
    raise AssertionError(f"never finished: {lost}")


def ids(tokenizer, text: str) -> list[int]:
    return encode_prompt(tokenizer, [{"role": "user", "content": text}], use_template=False)


@pytest.fixture(scope="module")
def alone(pretrained):
    """The greedy answers of two prompts, each decoded alone: what they must still be next to a failing row."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=1, eos_token_ids=[NEVER])
    return {text: engine.generate(ids(tokenizer, text), GREEDY).token_ids for text in ("The history of", "Water is")}


HOSTILE = {
    "seed 2**64 (beyond torch's generator)": dict(seed=2**64),
    "seed -2**63 - 1": dict(seed=-2**63 - 1),
    # Positive scores divided by these overflow to +inf for any model (the tiny one's logits are small).
    "repetition_penalty 1e-45, sampled": dict(repetition_penalty=1e-45, temperature=1.0),
    "repetition_penalty 1e-45, greedy": dict(repetition_penalty=1e-45, temperature=0.0),
    "temperature 1e-45": dict(temperature=1e-45),
}


@pytest.mark.parametrize("hostile", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_request_fails_alone(pretrained, alone, hostile) -> None:
    """A well-formed row is decoding when the hostile request joins, another joins after it: both well-formed
    rows end as they would alone, the hostile one ends with an error, and nothing is left running."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=3, eos_token_ids=[NEVER])
    first = engine.submit(ids(tokenizer, "The history of"), GREEDY)
    engine.step()
    engine.step()
    bad = engine.submit(ids(tokenizer, "A tiny language model"), GenerationSettings(max_new_tokens=40, **hostile))
    last = engine.submit(ids(tokenizer, "Water is"), GREEDY)
    run_until_done(engine, first, bad, last)
    assert (first.finish_reason, first.token_ids) == (FINISH_LENGTH, alone["The history of"])
    assert (last.finish_reason, last.token_ids) == (FINISH_LENGTH, alone["Water is"])
    assert bad.finish_reason == FINISH_ERROR and bad.error
    assert engine.load == (0, 0)


def test_scores_that_turn_non_finite_mid_decode_end_only_their_row(pretrained, alone, monkeypatch) -> None:
    """A row whose logits become NaN after a few tokens (as a tiny repetition penalty makes them) ends there with
    the library's message; the row beside it goes on."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER])
    bad = engine.submit(ids(tokenizer, "A tiny language model"), GenerationSettings(max_new_tokens=40, seed=1))
    good = engine.submit(ids(tokenizer, "Water is"), GREEDY)
    engine.step()
    engine.step()
    sampled = len(bad.token_ids)
    assert engine.load == (2, 0) and sampled >= 2  # both rows are decoding together
    bad_row = next(row for row in engine._rows if row.generation is bad)
    monkeypatch.setattr(bad_row, "processors", [*bad_row.processors, lambda seen, scores: scores * float("nan")])
    run_until_done(engine, bad, good)
    assert (bad.finish_reason, bad.error, len(bad.token_ids)) == (FINISH_ERROR, NON_FINITE_SCORES, sampled)
    assert (good.finish_reason, good.token_ids) == (FINISH_LENGTH, alone["Water is"])


def test_greedy_logits_that_turn_nan_end_only_their_row(pretrained, alone, monkeypatch) -> None:
    """A plain-greedy row (its token taken with the batch's one argmax, not through its sampler) whose logits
    become NaN mid-decode ends there with the library's message; the row beside it goes on."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER])
    bad = engine.submit(ids(tokenizer, "A tiny language model"), GenerationSettings(max_new_tokens=40,
                                                                                   temperature=0.0))
    good = engine.submit(ids(tokenizer, "Water is"), GREEDY)
    engine.step()
    engine.step()
    decoded = len(bad.token_ids)
    assert engine.load == (2, 0) and decoded >= 2 and all(row.greedy for row in engine._rows)
    bad_index = next(index for index, row in enumerate(engine._rows) if row.generation is bad)
    forward = model.forward

    def poisoned(*args, **inputs):
        out = forward(*args, **inputs)
        if out.logits.shape[0] == 2:  # while the bad row is in the batch
            out.logits[bad_index] = float("nan")
        return out

    monkeypatch.setattr(model, "forward", poisoned)
    run_until_done(engine, bad, good)
    assert (bad.finish_reason, bad.error, len(bad.token_ids)) == (FINISH_ERROR, NON_FINITE_SCORES, decoded)
    assert (good.finish_reason, good.token_ids) == (FINISH_LENGTH, alone["Water is"])


def test_a_failed_batch_step_fails_its_rows_and_keeps_what_failed(pretrained, alone) -> None:
    """An error out of the batch's own step (its forward: a MemoryError where the KV cache grows) fails every row in
    the batch, each keeping the exception itself in `failure` (a trainer's sampling reads an allocation failure there
    to end in its one out-of-memory line), and leaves the engine serving: the next request decodes as it would alone."""
    model, tokenizer = pretrained
    engine = GenerationEngine(model, tokenizer, max_batch=2, eos_token_ids=[NEVER])
    rows = [engine.submit(ids(tokenizer, text), GREEDY) for text in ("The history of", "Water is")]
    engine.step()  # both admitted (prefilled) and decoding
    assert all(not generation.done for generation in rows)
    no_memory = MemoryError()

    def failing_forward():
        raise no_memory

    forward, engine._forward = engine._forward, failing_forward
    engine.step()
    engine._forward = forward
    for generation in rows:
        assert generation.finish_reason == FINISH_ERROR and generation.failure is no_memory, generation.error
        assert generation.error == "MemoryError: "
    after = engine.submit(ids(tokenizer, "Water is"), GREEDY)
    run_until_done(engine, after)
    assert after.token_ids == alone["Water is"]
