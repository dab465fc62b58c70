"""The streamed reply's deltas (scripts/server/replies.py's DeltaStream) read each new id once: at every step they
equal the deltas of the old algorithm, which read the whole reply again at every token (kept below as the
reference, with the parse_assistant_ids it used), and a long reply decodes a number of ids linear in its length."""

from __future__ import annotations

import json
import random

import pytest

from dataset.chat_format import (CONTROL_TOKENS, IM_END, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END, _read_call,
                                 control_id, encode_text, parse_assistant_ids)
from model.generation import TextStream
from scripts.server.replies import UNFINISHED_CHARACTER, DeltaStream, ReplyReader, forced_call_prefix

TOOLS = ["wiki", "calc"]


# --------------------------------------------------------------------------- the reference: the old full re-parse
def _old_parse(tokenizer, ids, tool_names=None, unfinished=False):
    """parse_assistant_ids as it was before ReplyLayout: (content, reasoning_content, tool_calls, unread_calls)."""
    ids_of = {token: control_id(tokenizer, token) for token in CONTROL_TOKENS}
    ids = list(ids)
    if ids_of[IM_END] in ids:
        ids = ids[:ids.index(ids_of[IM_END])]
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=False)  # noqa: E731
    reasoning = ""
    if ids and ids[0] == ids_of[THINK]:
        end = ids.index(ids_of[THINK_END]) if ids_of[THINK_END] in ids else len(ids)
        reasoning, ids = decode(ids[1:end]).strip("\n"), ids[end + 1:]
    names = set(tool_names) if tool_names is not None else None
    opener, closer = ids_of[TOOL_CALL], ids_of[TOOL_CALL_END]
    content, calls, unread, start = [], [], 0, 0
    while start < len(ids):
        if ids[start] == opener:
            after = next((i for i in range(start + 1, len(ids)) if ids[i] in (opener, closer)), None)
            if after is not None and ids[after] == closer:
                call = _read_call(decode(ids[start + 1:after]), names)
                if call is None:
                    content.append(decode(ids[start:after + 1]))
                    unread += 1
                else:
                    calls.append(call)
                start = after + 1
                continue
            if after is None and unfinished:
                break
            unread += 1
        stop = start + 1
        while stop < len(ids) and ids[stop] != opener:
            stop += 1
        content.append(decode(ids[start:stop]))
        start = stop
    return "".join(content).strip("\n"), reasoning, calls, unread


class _OldDeltaStream:
    """DeltaStream as it was: the whole reply parsed again at every call."""

    def __init__(self, reader: ReplyReader) -> None:
        self.reader = reader
        self.reasoning, self.content, self.calls = "", "", 0

    def _read(self, ids, unfinished):
        content, reasoning, calls, _ = _old_parse(self.reader.tokenizer, ids, self.reader.tool_names, unfinished)
        cut = self.reader._stop_at(content)
        calls = calls if self.reader.parallel else calls[:1]
        return content if cut is None else content[:cut], reasoning, calls

    def deltas(self, generated, final=False):
        if final:
            content, reasoning, calls = self._read(self.reader.prefix + list(generated), False)
        else:
            content, reasoning, calls = self._read(self.reader.prefix + list(generated), True)
            hold = max((len(s) - 1 for s in self.reader.stop), default=0)
            content = content.rstrip(UNFINISHED_CHARACTER)
            content, reasoning = content[:max(0, len(content) - hold)], reasoning.rstrip(UNFINISHED_CHARACTER)
        out = []
        if reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            out.append({"reasoning_content": reasoning[len(self.reasoning):]})
            self.reasoning = reasoning
        if content.startswith(self.content) and len(content) > len(self.content):
            out.append({"content": content[len(self.content):]})
            self.content = content
        wire = self.reader.wire_calls(calls)
        for index in range(self.calls, len(wire)):
            out.append({"tool_calls": [{"index": index, **wire[index]}]})
        self.calls = max(self.calls, len(wire))
        return out


# --------------------------------------------------------------------------- tokenizers and random replies
@pytest.fixture(scope="module")
def chat_sentencepiece(sentencepiece_tokenizer):
    """The conftest's SentencePiece-style tokenizer (byte fallback, a decoder that strips the first space) with the
    chat format's control tokens, and one that also cleans up spaces (" ." -> "."), as some imported ones do."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    made = []
    for clean_up in (False, True):
        backend = Tokenizer.from_str(sentencepiece_tokenizer.backend_tokenizer.to_str())
        made.append(PreTrainedTokenizerFast(
            tokenizer_object=backend, unk_token="<unk>", eos_token="</s>",
            additional_special_tokens=list(CONTROL_TOKENS),
            clean_up_tokenization_spaces=clean_up,  # transformers ignores it for a BPE model unless forced:
            clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=clean_up))
    assert made[1].decode(encode_text(made[1], "a . b n't")) == "a. bn't"  # the clean-up is on
    return made


@pytest.fixture(scope="module")
def strips_two_spaces(chat_sentencepiece):
    """chat_sentencepiece's first tokenizer with a decoder that strips up to two first spaces (decodes_byte_runs_whole
    too): a run after a lone "▁" (its space stripped, so the text before the run is "") loses its own first space
    where the run alone would not, which the run's bytes cannot tell."""
    from tokenizers import Tokenizer, decoders
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(chat_sentencepiece[0].backend_tokenizer.to_str())
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 2, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>",
                                        additional_special_tokens=list(CONTROL_TOKENS))
    assert tokenizer.decode(tokenizer.convert_tokens_to_ids(["▁", "<0x20>", "a"])) == "a"
    return tokenizer


TEXTS = ("Hello", " there", ",", " world", "\n", "\n\n", " .", " n't", " 's", "STOP", "ST", "OP", "中文", "🙂", "é",
         "</think>", "<tool_call>", " a ca", "北", "\ufffd", "x")
STOPS = ((), ("STOP",), ("\n\n",), ("OP", "中"), ("a c",))


def _random_reply(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Ids a model might write, and worse: text, multi-byte characters cut into single bytes, stray bytes, random
    ids, the control tokens anywhere, good and bad calls, a thought at the start, <|im_end|> now and then."""
    ids_of = {token: control_id(tokenizer, token) for token in CONTROL_TOKENS}
    byte_ids = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    sentencepiece = byte_ids[0xE4] != tokenizer.unk_token_id and byte_ids[0xE4] is not None
    ids = [ids_of[THINK]] if rng.random() < 0.4 else []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.35:
            ids += encode_text(tokenizer, rng.choice(TEXTS))
        elif kind < 0.5:
            ids.append(ids_of[rng.choice((THINK, THINK_END, TOOL_CALL, TOOL_CALL_END, TOOL_CALL, THINK_END))])
        elif kind < 0.6:
            name = rng.choice(TOOLS + ["nope"])
            body = json.dumps({"name": name, "arguments": {"q": rng.choice(TEXTS)}}, ensure_ascii=False)
            if rng.random() < 0.2:
                body = body[:rng.randrange(len(body))]
            ids += [ids_of[TOOL_CALL], *encode_text(tokenizer, body), ids_of[TOOL_CALL_END]]
        elif kind < 0.7 and sentencepiece:  # a character in byte tokens, now and then with a stray byte after it
            ids += [byte_ids[b] for b in rng.choice(("中", "é", "𝍁", "🙂")).encode()]
            if rng.random() < 0.3:
                ids.append(byte_ids[rng.choice((0x80, 0xEA, 0xE4))])
        elif kind < 0.8 and sentencepiece:  # a long run of bytes: characters, some cut short or broken, a space first
            ids += [byte_ids[b] for b in rng.choice(SPACES_FIRST) + _byte_run(rng, rng.randrange(2, 25))]
        elif kind < 0.8:  # a character's ids one by one, or random ids: byte-level tokens of broken UTF-8
            ids += encode_text(tokenizer, rng.choice(("中文字", "🙂🙂", "é")))[:rng.randrange(1, 4)]
            if rng.random() < 0.5:
                ids.append(rng.randrange(len(CONTROL_TOKENS) + 8, len(tokenizer)))
        elif kind < 0.97:
            ids += encode_text(tokenizer, " ".join(rng.choice(TEXTS) for _ in range(rng.randrange(1, 6))))
        else:
            ids.append(ids_of[IM_END])
    return ids


# Byte sequences no UTF-8 decoder accepts: a lone continuation byte, a character cut short by another, an overlong
# "/", a UTF-16 surrogate, a code point past U+10FFFF, bytes that never occur.
BROKEN_BYTES = (b"\x80", b"\xe4\xb8", b"\xf0\x9f\x99", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff",
                b"\xf8")
RUN_TEXT = "中文字北京🙂🚀é𝍁 ok"
# What a byte run may begin with: nothing mostly, spaces (which the decoder strips off the text's start), a space
# then a stray byte (the whole run U+FFFDs, the space's too)
SPACES_FIRST = (b"", b"", b"", b" ", b" ", b"  ", b" \x80")


def _byte_run(rng: random.Random, characters: int) -> bytes:
    """The bytes of `characters` characters, Chinese and emoji mostly, now and then a broken sequence among them."""
    out = b""
    for _ in range(characters):
        out += rng.choice(BROKEN_BYTES) if rng.random() < 0.08 else rng.choice(RUN_TEXT).encode()
    return out


def _same_deltas_at_every_step(tokenizer, rng: random.Random, length: int) -> None:
    ids = _random_reply(tokenizer, rng, length)
    forced = rng.choice((None, None, None, "", "wiki"))
    reader = ReplyReader(tokenizer, [forced] if forced else TOOLS, forced_call_prefix(tokenizer, forced),
                         stop=rng.choice(STOPS), parallel_tool_calls=rng.random() < 0.8)
    new, old = DeltaStream(reader), _OldDeltaStream(reader)  # one reader: the calls' ids are the same
    n = 0
    while n < len(ids):
        n = min(len(ids), n + rng.choice((1, 1, 1, 2, 5)))  # the server reads after one id, or several
        # the ids so far, or the whole list with the end of those generated so far (the server's way: no copy)
        sent = new.deltas(ids[:n]) if rng.random() < 0.5 else new.deltas(ids, end=n)
        assert sent == old.deltas(ids[:n]), (ids, n)
    assert new.deltas(ids, final=True) == old.deltas(ids, final=True), ids
    assert (new.content, new.reasoning, new.calls) == (old.content, old.reasoning, old.calls)
    # The engine's question after each token, with the text it shows (TextStream's: special tokens left out): the
    # old answer parsed the whole reply once the text held a stop string.
    stopping = ReplyReader(tokenizer, reader.tool_names, reader.prefix, reader.stop, reader.parallel)
    shown = TextStream(tokenizer)  # the engine's text, which only grows
    for n in range(1, len(ids) + 1):
        shown.push(ids[n - 1])
        text = shown.text
        was = any(stop in text for stop in reader.stop) and reader._stop_at(
            _old_parse(tokenizer, reader.prefix + ids[:n], reader.tool_names, True)[0]) is not None
        assert stopping.content_stopped(ids[:n], text) == was, (ids, n)


def test_the_stream_sends_what_the_whole_reparse_sent_byte_level(tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(150):
        _same_deltas_at_every_step(tokenizer, rng, rng.randrange(1, 60))


def test_the_stream_sends_what_the_whole_reparse_sent_sentencepiece(chat_sentencepiece) -> None:
    rng = random.Random(1)
    for _ in range(150):
        _same_deltas_at_every_step(rng.choice(chat_sentencepiece), rng, rng.randrange(1, 60))


def test_parse_assistant_ids_reads_as_it_did(tokenizer, chat_sentencepiece) -> None:
    """parse_assistant_ids, now ReplyLayout's spans read by read_span, reads every reply as the old loop did."""
    rng = random.Random(2)
    for _ in range(300):
        chosen = rng.choice([tokenizer, *chat_sentencepiece])
        ids = _random_reply(chosen, rng, rng.randrange(0, 40))
        names = rng.choice((None, TOOLS, []))
        for unfinished in (False, True):
            reply = parse_assistant_ids(chosen, ids, names, unfinished)
            assert (reply.content, reply.reasoning_content, reply.tool_calls, reply.unread_calls) == \
                _old_parse(chosen, ids, names, unfinished), ids


# --------------------------------------------------------------------------- work: ids decoded, not time
def _decoded_ids(tokenizer, monkeypatch, ids: list[int], stop=()) -> int:
    """How many ids the tokenizer decodes (decode, convert_ids_to_tokens) while a stream sends `ids` one at a time
    and then the final deltas."""
    count = [0]

    def counting(method):
        def wrapped(token_ids, *args, **kwargs):
            count[0] += len(token_ids) if isinstance(token_ids, list) else 1
            return method(token_ids, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(tokenizer, "decode", counting(tokenizer.decode))
    monkeypatch.setattr(tokenizer, "convert_ids_to_tokens", counting(tokenizer.convert_ids_to_tokens))
    stream = DeltaStream(ReplyReader(tokenizer, TOOLS, stop=stop))
    sent = "".join(d.get("content", "") for n in range(1, len(ids) + 1) for d in stream.deltas(ids[:n]))
    sent += "".join(d.get("content", "") for d in stream.deltas(ids, final=True))
    monkeypatch.undo()
    assert sent == ReplyReader(tokenizer, TOOLS, stop=stop).message(ids)["content"]
    return count[0]


@pytest.mark.parametrize("shape", ["content", "a thought, then content", "calls among the content"])
def test_a_long_streamed_reply_decodes_a_number_of_ids_linear_in_its_length(tokenizer, monkeypatch, shape) -> None:
    """The old stream decoded the whole reply at every token: about N * N / 2 ids for N tokens (2 million at
    2,000). Now each id is decoded a few times: the new ones with a few before them, a settled part once, and the
    whole reply once at the end."""
    words = encode_text(tokenizer, " and so the story goes on, 中文 🙂 again\n" * 400)
    call = [control_id(tokenizer, TOOL_CALL), *encode_text(tokenizer, '{"name": "wiki", "arguments": {}}'),
            control_id(tokenizer, TOOL_CALL_END)]
    if shape == "content":
        ids = words[:2000]
    elif shape == "a thought, then content":
        ids = [control_id(tokenizer, THINK), *words[:1000], control_id(tokenizer, THINK_END), *words[:1000]]
    else:
        ids = [*words[:500], *call, *words[:500], *call, *words[:1000]]
    assert len(ids) >= 2000
    assert _decoded_ids(tokenizer, monkeypatch, ids, stop=("STOP",)) < 16 * len(ids)


def test_the_server_stream_copies_no_growing_list_of_ids(tokenizer) -> None:
    """scripts/server/streaming.py handed the stream a copy of the ids generated so far at every piece
    (token_ids[:generated]): N * N / 2 ids copied for N tokens, the quadratic work again. It now passes the engine's
    list and the count; what is copied from it stays linear (the new ids once, the whole reply once at the end)."""
    import asyncio
    from types import SimpleNamespace

    from scripts.server.protocol import CompletionId
    from scripts.server.streaming import completion_events

    class CountingList(list):
        copied = 0

        def __getitem__(self, index):
            got = super().__getitem__(index)
            if isinstance(index, slice):
                CountingList.copied += len(got)
            return got

    ids = CountingList(encode_text(tokenizer, " and so the story goes on\n" * 400)[:2000])

    async def pieces():
        for generated in range(1, len(ids) + 1):
            yield "", generated

    completion = SimpleNamespace(
        reader=ReplyReader(tokenizer, TOOLS), pieces=pieces, generation=SimpleNamespace(token_ids=ids),
        logprobs=lambda start, end: None, check_finished=lambda: None, finish_reason=lambda: "length",
        usage=lambda: {}, cancel=lambda: None)

    async def events() -> list[str]:
        return [event async for event in completion_events(completion, CompletionId.new("m"), False)]

    sent = asyncio.run(events())
    content = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in sent if "choices" in e)
    assert content == ReplyReader(tokenizer, TOOLS).message(list(ids))["content"]
    assert CountingList.copied < 4 * len(ids)


def test_asking_whether_the_content_stopped_decodes_a_number_of_ids_linear_in_the_reply(tokenizer,
                                                                                          monkeypatch) -> None:
    """The engine asks the reader after each token whether the content holds a stop string; once the text held
    one (here in a thought, where it stops nothing), each answer parsed the whole reply again: about N * N / 2 ids
    decoded. Now the text is searched from where a stop string could still begin and the reply read as a stream
    reads it."""
    words = encode_text(tokenizer, " and so the story goes on\n" * 400)[:2000]
    ids = [control_id(tokenizer, THINK), *encode_text(tokenizer, "no STOP here"), control_id(tokenizer, THINK_END),
           *words, *encode_text(tokenizer, " STOP")]
    count = [0]
    decode = tokenizer.decode

    def counting(token_ids, *args, **kwargs):
        count[0] += len(token_ids)
        return decode(token_ids, *args, **kwargs)

    reader = ReplyReader(tokenizer, TOOLS, stop=("STOP",))
    monkeypatch.setattr(tokenizer, "decode", counting)
    text = "no STOP here"  # what the engine shows grows; its words do not matter here, only that it holds a stop
    stopped = [n for n in range(1, len(ids) + 1) if reader.content_stopped(ids[:n], text + " x" * n)]
    monkeypatch.undo()
    assert stopped[0] == len(ids)  # the stop string in the content, not the one in the thought
    assert count[0] < 16 * len(ids)


def test_run_text_equals_the_whole_decode_under_space_clean_up(chat_sentencepiece) -> None:
    """A tokenizer that cleans up spaces (" ." to ".", " 's" to "'s") changes text across a cut: _RunText's text at
    every length, read one, two or three ids at a time, is still tokenizer.decode of the whole run."""
    from scripts.server.replies import _RunText

    cleaning = chat_sentencepiece[1]
    ids = [i for piece in ("It", " is", " here", " ,", " they", " n", "'t", " said", " .", " It", " '", "s", " ok",
                           " !", " Is", " it", " ?", " Yes", " ,", " we", " '", "ve", " done", " .")
           for i in encode_text(cleaning, piece)]
    assert cleaning.decode(ids) != cleaning.decode(ids, clean_up_tokenization_spaces=False)
    for step in (1, 2, 3):
        grown: list[int] = []
        run = _RunText(cleaning, grown, 0)
        for n in range(step, len(ids) + step, step):
            grown[:] = ids[:n]
            assert run.text() == cleaning.decode(ids[:n], skip_special_tokens=False), (step, n)


def test_a_byte_run_under_space_clean_up_is_decoded_not_made_from_its_bytes(chat_sentencepiece) -> None:
    """The space-cleaning tokenizer is not decodes_byte_runs_whole: its clean-up edits a run's text (" ." spelled in
    bytes reads "."), so its runs are decoded, not made from their bytes: a run of characters long past the first
    checks, then " ." in bytes, is tokenizer.decode at every length (a mutant that made every tokenizer's runs
    from their bytes survived the random runs)."""
    from scripts.server.replies import _RunText

    cleaning = chat_sentencepiece[1]
    ids = [cleaning.convert_tokens_to_ids(f"<0x{b:02X}>") for b in ("北京" * 8 + " . 中 , x").encode()]
    assert cleaning.unk_token_id not in ids
    assert cleaning.decode(ids) != cleaning.decode(ids, clean_up_tokenization_spaces=False)
    grown: list[int] = []
    run = _RunText(cleaning, grown, 0)
    for n in range(1, len(ids) + 1):
        grown[:] = ids[:n]
        assert run.text() == cleaning.decode(ids[:n], skip_special_tokens=False), n


def test_run_text_equals_the_whole_decode_through_long_byte_runs(chat_sentencepiece, strips_two_spaces) -> None:
    """Runs of byte-fallback ids (Chinese and emoji on a vocabulary without them), long, at the start of the text
    and after words or a lone "▁", one or two space bytes first, broken by a stray byte, a character cut short or an
    overlong: _RunText's text, which makes a run's text from its bytes, is tokenizer.decode of the whole run at
    every length, read one to five ids at a time (the decoder turns a whole run into U+FFFDs for one bad byte, and
    strips a first space, or two)."""
    from scripts.server.replies import _RunText

    for tokenizer in [*chat_sentencepiece, strips_two_spaces]:
        byte_ids = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
        rng = random.Random(3)
        for _ in range(60):
            ids = []
            for _ in range(rng.randrange(1, 5)):
                if rng.random() < 0.5:
                    ids += tokenizer.convert_tokens_to_ids([rng.choice(("▁", "▁a", "▁ca", "f", "北", "a"))])
                ids += [byte_ids[b] for b in rng.choice(SPACES_FIRST) + _byte_run(rng, rng.randrange(0, 40))]
            for step in (1, 2, 3, 5):
                grown: list[int] = []
                run = _RunText(tokenizer, grown, 0)
                for n in range(step, len(ids) + step, step):
                    grown[:] = ids[:n]
                    assert run.text() == tokenizer.decode(ids[:n], skip_special_tokens=False), (ids, step, n)


@pytest.mark.parametrize("first", [b"", b"\x80", b" ", b"  "], ids=["characters", "a stray byte first",
                                                                  "a space first", "two spaces first"])
def test_a_long_reply_in_byte_fallback_tokens_decodes_a_number_of_ids_linear_in_its_length(chat_sentencepiece,
                                                                                           monkeypatch, first):
    """2,000 byte-fallback ids of Chinese and emoji (a model with a Llama-style vocabulary that lacks them writes
    them so): no cut was made inside a run of byte tokens, so each new id decoded the whole run again, about
    N * N / 2 ids (2 million). Now a run's text is made from its bytes: each id is decoded a few times, whether the
    run reads as characters, after a stray byte first as U+FFFDs only (the decoder's reading of a run with a bad
    byte anywhere: one put later would turn text already sent into U+FFFDs, which the full re-parse could not take
    back either), or begins with a space the decoder strips off the reply's start (that run was decoded again at
    every token: its bytes did not read as the decode)."""
    tokenizer = chat_sentencepiece[0]
    text = first + ("中文字北京" * 100 + "🙂🚀" * 100).encode()
    ids = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in text][:2000 + len(first)]  # whole characters
    assert len(ids) >= 2000 and tokenizer.unk_token_id not in ids
    assert _decoded_ids(tokenizer, monkeypatch, ids) < 16 * len(ids)


def test_a_long_byte_run_after_one_whose_bytes_did_not_read_as_decoded_is_still_made_from_its_bytes(
        strips_two_spaces, monkeypatch) -> None:
    """A run after a lone "▁" that begins with a space byte does not read as its bytes under a decoder that strips
    two first spaces (the text before it is "", its space stripped; the run's own is stripped too), so that run is
    decoded; the next run, after a word, is made from its bytes again: 1,995 of them cost a few decodes each (a
    mutant that kept decoding every later run once one had not read right survived)."""
    from scripts.server.replies import _RunText

    tokenizer = strips_two_spaces
    byte_ids = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (" 北京" * 2 + "中文字北京" * 200).encode()]
    first = tokenizer.convert_tokens_to_ids(["▁"]) + byte_ids[:14]
    rest = byte_ids[14:14 + 1995]  # whole characters: 133 x "中文字北京"
    unread = _RunText(tokenizer, first, 0)
    assert unread.text() == "北京 北京" and unread._unmade is not None  # the premise: its bytes did not read right
    ids = first + encode_text(tokenizer, " a ca") + rest
    assert len(rest) == 1995 and tokenizer.unk_token_id not in ids
    assert _decoded_ids(tokenizer, monkeypatch, ids) < 16 * len(ids)


def test_which_decoders_read_a_byte_run_as_a_whole(tokenizer, chat_sentencepiece) -> None:
    """decodes_byte_runs_whole: Llama's decoder yes; a byte-level one, a clean-up of spaces, a Replace after
    ByteFallback (it would edit the run's text: a "▁" spelled in bytes), a Strip before Fuse (it would strip each
    run) or of trailing characters, no."""
    from tokenizers import Tokenizer, decoders
    from transformers import PreTrainedTokenizerFast

    from dataset.tokenization import decodes_byte_runs_whole

    assert decodes_byte_runs_whole(chat_sentencepiece[0])
    assert not decodes_byte_runs_whole(chat_sentencepiece[1]) and not decodes_byte_runs_whole(tokenizer)
    replace, fallback, fuse = decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()
    strip_first, strip_last = decoders.Strip(" ", 1, 0), decoders.Strip(" ", 0, 1)
    for chain, reads in [([fallback], True),
                         ([replace, fallback, fuse], True),
                         ([replace, fallback, fuse, strip_first], True),
                         ([fallback, replace, fuse], False),
                         ([replace, fallback, strip_first, fuse], False),
                         ([replace, fallback, fuse, strip_last], False),
                         ([replace, fuse], False)]:
        backend = Tokenizer.from_str(chat_sentencepiece[0].backend_tokenizer.to_str())
        backend.decoder = decoders.Sequence(chain)
        assert decodes_byte_runs_whole(PreTrainedTokenizerFast(tokenizer_object=backend)) == reads, chain


def test_a_run_at_the_start_loses_what_the_decoders_strips_take_off(chat_sentencepiece, strips_two_spaces) -> None:
    """start_strips reads the decoder's Strip steps, and stripped_start applies them as tokenizers' Strip decoder
    does to the fused text (the reference: the decoder itself, on one piece)."""
    from tokenizers import decoders

    from dataset.tokenization import start_strips, stripped_start

    assert start_strips(chat_sentencepiece[0]) == ((" ", 1),) and start_strips(strips_two_spaces) == ((" ", 2),)
    chains = [[(" ", 1)], [(" ", 2)], [(" ", 1), ("x", 2)], [("x", 1), (" ", 3)]]
    for chain in chains:
        decoder = decoders.Sequence([decoders.Strip(character, count, 0) for character, count in chain])
        for text in ("", " ", "  ", "   中", "x ", " x", "xx  x", " \ufffd", "\ufffd ", "中 "):
            assert stripped_start(text, chain) == decoder.decode([text]), (chain, text)


def test_a_stream_read_with_fewer_ids_than_before_is_refused(tokenizer) -> None:
    """The stream reads only the ids after those it was given: asked again with fewer, it would send text from ids
    it no longer has; it refuses in one line instead."""
    ids = encode_text(tokenizer, "Hello there, world")
    stream = DeltaStream(ReplyReader(tokenizer, TOOLS, [], stop=(), parallel_tool_calls=True))
    stream.read(ids, 3)
    with pytest.raises(ValueError, match=r"^DeltaStream\.read: 2 ids after 3; the ids of a stream only grow$"):
        stream.read(ids, 2)
