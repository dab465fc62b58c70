"""OpenAI's `logprobs` / `top_logprobs` through scripts/serve.py's app (under uvicorn in this process), read with the
official `openai` client, whole and streamed. The reference is independent of the server and the engine: the model
loaded again, one plain forward of the template's prompt ids and the generated ids in float64, log_softmax at each
position; a token's id is found from its bytes through the tokenizer's own vocabulary and GPT-2's byte alphabet."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-4  # float32 logits through the engine's KV cache against a float64 forward without one
HI = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def sft_app(tiny_models, serve_app, threaded_server):
    with threaded_server(serve_app(tiny_models.sft, max_batch=4)) as running:
        yield running.url


@pytest.fixture(scope="module")
def endless_app(endless_model, serve_app, threaded_server):
    with threaded_server(serve_app(endless_model, max_batch=4)) as running:
        yield running.url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


class Reference:
    """A model directory loaded on its own: its log-probabilities after a prompt, and token ids read back from
    bytes."""

    def __init__(self, model_dir) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        from model.loading import load_model

        self.model, self.tokenizer = load_model(model_dir)
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self.id_of: dict[bytes, int] = {}
        for token, index in self.tokenizer.get_vocab().items():
            data = (token.encode() if index in self.tokenizer.added_tokens_decoder
                    else bytes(byte_of[char] for char in token))
            assert self.id_of.setdefault(data, index) == index  # no two tokens share their bytes
        self.bytes_of = {index: data for data, index in self.id_of.items()}

    def prompt(self, messages) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if not isinstance(ids, list) else ids)

    def logprobs(self, prompt: list[int], generated: list[int]) -> torch.Tensor:
        """(len(generated), vocab): log_softmax of the model's logits before each generated token."""
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + generated])).logits[0].double()
        return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]

    def check(self, messages, content, top: int) -> list[int]:
        """Every entry of `content` (the client's ChatCompletionTokenLogprob list) against the forward; the ids."""
        ids = [self.id_of[bytes(entry.bytes)] for entry in content]
        expected = self.logprobs(self.prompt(messages), ids)
        for step, (token, entry) in enumerate(zip(ids, content)):
            assert entry.token == bytes(entry.bytes).decode("utf-8", errors="replace")
            assert entry.logprob == pytest.approx(expected[step, token].item(), abs=TOLERANCE)
            values, best = expected[step].topk(top)
            assert [self.id_of[bytes(t.bytes)] for t in entry.top_logprobs] == best.tolist()
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=TOLERANCE)
            assert all(t.token == bytes(t.bytes).decode("utf-8", errors="replace") for t in entry.top_logprobs)
            logprobs = [t.logprob for t in entry.top_logprobs]
            assert logprobs == sorted(logprobs, reverse=True)
            for alternative in entry.top_logprobs:  # the chosen token among the most likely: the same number
                if alternative.bytes == entry.bytes:
                    assert alternative.logprob == entry.logprob
        return ids


@pytest.fixture(scope="module")
def sft_reference(tiny_models):
    return Reference(tiny_models.sft)


@pytest.fixture(scope="module")
def endless_reference(endless_model):
    return Reference(endless_model)


def streamed(api: openai.OpenAI, **request) -> tuple[str, list, list]:
    """A streamed completion's text, its chunks with choices, and the logprobs entries of those chunks joined."""
    chunks = [c for c in api.chat.completions.create(stream=True, **request) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks, [entry for c in chunks if c.choices[0].logprobs for entry in c.choices[0].logprobs.content]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0, frequency_penalty=0.0),
                                      dict(temperature=1.5, top_p=0.9, seed=4, frequency_penalty=1.0,
                                           extra_body={"top_k": 40})])
def test_logprobs_are_the_model_s_own_at_each_step(sft_app, sft_reference, tiny_models, sampling) -> None:
    """The raw distribution of each step, whatever the sampling: every generated token has its entry, the closing
    <|im_end|> included, and top_logprobs the most likely tokens of the same distribution, most likely first."""
    api = client(sft_app)
    response = api.chat.completions.create(model="m", messages=HI, logprobs=True, top_logprobs=3, **sampling)
    choice = response.choices[0]
    content = choice.logprobs.content
    ids = sft_reference.check(HI, content, 3)
    assert choice.logprobs.refusal is None and len(content) == response.usage.completion_tokens
    assert ids[-1] == sft_reference.tokenizer.eos_token_id
    assert b"".join(bytes(e.bytes) for e in content[:-1]).decode() == choice.message.content == tiny_models.reply
    text, chunks, entries = streamed(api, model="m", messages=HI, logprobs=True, top_logprobs=3, **sampling)
    assert text == tiny_models.reply and entries == content  # the same tokens, the same entries, in order
    assert chunks[0].choices[0].logprobs is None  # the role's chunk carries no token
    assert all(c.choices[0].logprobs is None or c.choices[0].logprobs.content for c in chunks)
    assert sum(bool(c.choices[0].logprobs) for c in chunks) > 2  # spread over the stream, not sent at the end


def test_logprobs_without_top_logprobs_and_the_refusals(sft_app, sft_reference) -> None:
    api = client(sft_app)
    response = api.chat.completions.create(model="m", messages=HI, logprobs=True, temperature=0.0, max_tokens=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 3 and all(entry.top_logprobs == [] for entry in content)
    sft_reference.check(HI, content, 0)
    plain = api.chat.completions.create(model="m", messages=HI, logprobs=False, temperature=0.0, max_tokens=3)
    assert plain.choices[0].logprobs is None
    wide = api.chat.completions.create(model="m", messages=HI, logprobs=True, top_logprobs=20, max_tokens=2)
    sft_reference.check(HI, wide.choices[0].logprobs.content, 20)
    for fields, param, phrase in ((dict(top_logprobs=2), "top_logprobs", 'top_logprobs: needs "logprobs": true'),
                                  (dict(logprobs=False, top_logprobs=0), "top_logprobs", "needs"),
                                  (dict(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
                                  (dict(logprobs=True, top_logprobs=-1), "top_logprobs", "greater than or equal")):
        response = httpx.post(f"{sft_app}/v1/chat/completions", json={"messages": HI, **fields}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and phrase in error["message"], error


def test_a_request_with_logprobs_batched_with_one_without(endless_app, endless_reference) -> None:
    """A long stream without logprobs is running when a request with them arrives: they decode in the same batch;
    the first carries no logprobs and generates what it generates alone, the second's match the forward."""
    api = client(endless_app)
    long = dict(model="m", messages=[{"role": "user", "content": "Go on"}], temperature=0.0, max_tokens=300)
    asking = dict(model="m", messages=HI, temperature=1.2, seed=9, max_tokens=24, logprobs=True, top_logprobs=2)
    before = httpx.get(f"{endless_app}/health").json()
    started = threading.Event()

    def run_long() -> tuple[str, list]:
        chunks = []
        for chunk in api.chat.completions.create(stream=True, **long):
            chunks.append(chunk)
            if len(chunks) == 3:
                started.set()  # it is decoding: the next request joins its batch
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_long)
        assert started.wait(60)
        with_logprobs = api.chat.completions.create(**asking)
        text, chunks = running.result()
    after = httpx.get(f"{endless_app}/health").json()
    assert after["batched_rows"] - before["batched_rows"] > after["decode_steps"] - before["decode_steps"]
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    assert text == streamed(api, **long)[0]
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == with_logprobs.usage.completion_tokens > 3
    endless_reference.check(HI, content, 2)
    alone = api.chat.completions.create(**asking).choices[0].logprobs.content
    assert [e.bytes for e in alone] == [e.bytes for e in content]  # the tokens it draws alone


def test_an_entry_is_json_whatever_the_logprob() -> None:
    """A token the model rules out (logit -inf) is sent as OpenAI's and vLLM's -9999, not as -Infinity, which is not
    JSON; part of a character is U+FFFD in `token` and exact in `bytes`."""
    from scripts.server.protocol import token_logprob_body

    assert token_logprob_body(b"\xe4\xbd", float("-inf")) == {"token": "\ufffd", "logprob": -9999.0,
                                                              "bytes": [0xE4, 0xBD]}
    assert token_logprob_body("你".encode(), -0.5, []) == {"token": "你", "logprob": -0.5, "bytes": [0xE4, 0xBD, 0xA0],
                                                          "top_logprobs": []}
