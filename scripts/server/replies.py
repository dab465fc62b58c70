"""A generated reply read back into OpenAI's message fields: content, reasoning_content and tool_calls (with their
ids), whole or as the deltas of a stream. The reading is the library's (dataset/chat_format.py's
parse_assistant_ids: by control ids, never by text); a call the model wrote badly stays in the content."""

from __future__ import annotations

import codecs
import json
import uuid
from collections.abc import Sequence
from typing import Any

from dataset.chat_format import (CALL, REASONING, TOOL_CALL, ReplyLayout, control_id, encode_text, parse_assistant_ids,
                                  read_span)
from dataset.tokenization import (byte_fallback_value, decodes_byte_runs_whole, is_byte_fallback, start_strips,
                                  stripped_start)
from model.generation import STREAM_CONTEXT_IDS

FINISH_TOOL_CALLS = "tool_calls"
UNFINISHED_CHARACTER = "\ufffd"  # what decoding shows for the first bytes of a character still being generated


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_call_prefix(tokenizer: Any, tool_name: str | None) -> list[int]:
    """The start of the reply that tool_choice imposes, appended to the prompt: nothing (None: the model decides),
    <tool_call> ("": some tool) or <tool_call> and the call's text up to its arguments (a tool's name)."""
    if tool_name is None:
        return []
    ids = [control_id(tokenizer, TOOL_CALL)]
    if tool_name:
        ids += encode_text(tokenizer, f'{{"name": {json.dumps(tool_name, ensure_ascii=False)}, "arguments":')
    return ids


class ReplyReader:
    """Reads one completion's generated ids (after `prefix`, the part of the reply the prompt imposed) with the
    tools a call may name (`tool_names`: under a named tool_choice, that tool only -- the imposed prefix names it,
    and the model's text after it must not rename it); `stop` strings cut the content where the first one begins,
    as they cut plain text."""

    def __init__(self, tokenizer: Any, tool_names: Sequence[str], prefix: Sequence[int] = (),
                 stop: Sequence[str] = (), parallel_tool_calls: bool = True) -> None:
        self.tokenizer, self.tool_names, self.prefix = tokenizer, list(tool_names), list(prefix)
        self.stop, self.parallel = tuple(s for s in stop if s), parallel_tool_calls
        self._ids: dict[int, str] = {}  # a call's id, by its place in the reply, the same in every chunk
        # The imposed prefix as content shows it (a call the model then wrote badly): prompt, not generated text,
        # which a stop string is not looked for in, as OpenAI's apply to generated text only.
        self._prefix_text = parse_assistant_ids(tokenizer, self.prefix, self.tool_names).content if prefix else ""
        self._searched = 0  # content_stopped's text: no stop string begins before this, whatever text follows
        self._stop_reading: DeltaStream | None = None  # content_stopped's reading, once the text holds a stop string

    def fields(self, generated: Sequence[int]) -> tuple[str, str, list[dict]]:
        """content, reasoning_content and the calls ([{"name", "arguments": dict}]) of the whole reply."""
        return self.read(self.prefix + list(generated))

    def read(self, ids: Sequence[int], unfinished: bool = False) -> tuple[str, str, list[dict]]:
        """fields() for the reply's ids, the imposed prefix included (`unfinished`: parse_assistant_ids's)."""
        reply = parse_assistant_ids(self.tokenizer, ids, self.tool_names, unfinished)
        return self.cut(reply.content, reply.reasoning_content, reply.tool_calls)

    def cut(self, content: str, reasoning: str, calls: list[dict]) -> tuple[str, str, list[dict]]:
        """The fields of a reading (parse_assistant_ids's) as the request wants them: the content cut where the
        first stop string begins, and only the first call unless parallel_tool_calls."""
        at = self._stop_at(content)
        return content if at is None else content[:at], reasoning, calls if self.parallel else calls[:1]

    def _stop_at(self, content: str) -> int | None:
        """Where the first stop string begins in the content (after the imposed prefix's text), or None."""
        start = len(self._prefix_text) if self._prefix_text and content.startswith(self._prefix_text) else 0
        cuts = [at for at in (content.find(stop, start) for stop in self.stop) if at >= 0]
        return min(cuts) if cuts else None

    def content_stopped(self, generated: Sequence[int], text: str) -> bool:
        """Whether the content of the reply so far (`generated`, whose text is `text`) holds a stop string: the
        generation ends there. A stop string in a thought or inside a call is none (the engine, which sees text only,
        would end the reply in either). The reply is read only once the text holds one (one joined across a call's
        span is still cut by read()). The engine asks after each token with the reply so far, which only grows: the
        text is searched from where a stop string could still begin, and the reply is read as a stream reads it
        (DeltaStream's reading: the new ids only), so a reply costs its length in all, not at every token."""
        if self._stop_reading is None:
            if not any(text.find(stop, max(0, self._searched - len(stop) + 1)) >= 0 for stop in self.stop):
                self._searched = len(text)
                return False
            self._stop_reading = DeltaStream(self)
        return self._stop_at(self._stop_reading.read(generated, len(generated))[0]) is not None

    def wire_calls(self, calls: list[dict], first: int = 0) -> list[dict[str, Any]]:
        """Calls in OpenAI's form: an id each (kept for the reply), arguments as a JSON string (`first`: the place
        in the reply of the first of `calls`)."""
        return [{"id": self._ids.setdefault(i, tool_call_id()), "type": "function",
                 "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
                for i, call in enumerate(calls, first)]

    def message(self, generated: Sequence[int]) -> dict[str, Any]:
        """The assistant message's fields besides its role: content (None when there is only a call, as OpenAI
        sends it), and reasoning_content and tool_calls where there are any."""
        content, reasoning, calls = self.fields(generated)
        message: dict[str, Any] = {"content": content or (None if calls else "")}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = self.wire_calls(calls)
        return message

    def finish_reason(self, generated: Sequence[int], engine_reason: str | None) -> str | None:
        """"tool_calls" when the model stopped after calling tools, else the engine's reason."""
        return FINISH_TOOL_CALLS if engine_reason == "stop" and self.fields(generated)[2] else engine_reason


class _ByteRun:
    """The text of ids[start:end], all byte-fallback tokens, at the end of a _RunText's ids, for a tokenizer that
    decodes_byte_runs_whole, grown a byte at a time without decoding: the text before the run, then the run's bytes
    as UTF-8 while they are valid and end on a whole character, else a U+FFFD for each byte. A run that begins the
    text has what the decoder strips off the text's start (`strips`: start_strips, Llama's first space) taken off
    its own."""

    def __init__(self, start: int, before: str, strips: tuple[tuple[str, int], ...] = ()) -> None:
        self.start, self.end, self.before, self.strips = start, start, before, strips
        self.checks = _BYTE_RUN_CHECKS
        self._utf8 = codecs.getincrementaldecoder("utf-8")()  # strict: a stray byte raises
        self._text, self._valid = "", True

    def push(self, byte: int) -> None:
        self.end += 1
        if self._valid:
            try:
                self._text += self._utf8.decode(bytes((byte,)))
            except UnicodeDecodeError:
                self._valid, self._text = False, ""

    @property
    def whole(self) -> bool:
        """The run's bytes are valid UTF-8 and end on a whole character (else its text is all U+FFFD)."""
        return self._valid and not self._utf8.getstate()[0]

    def text(self) -> str:
        own = self._text if self.whole else UNFINISHED_CHARACTER * (self.end - self.start)
        return self.before + (stripped_start(own, self.strips) if self.strips else own)


# A byte run's text is checked against the tokenizer's own decode at its first calls where it reads as characters
# (not all U+FFFD): whatever else a decoder does at the start of the text shows there (a Strip of more than one
# space, whose first the text before a run took, strips the run's too).
_BYTE_RUN_CHECKS = 4


class _RunText:
    """tokenizer.decode of a run of ids that only grows (ids[start:], special tokens as their text, as
    parse_assistant_ids decodes), equal at every length to decoding the whole run, though each call decodes only the
    ids since the last cut, after STREAM_CONTEXT_IDS ids before it (their text taken off, as TextStream does: what a
    decoder does at the start of its input, a SentencePiece one's stripped space, happens to them). A cut is made
    only after an id that is no byte-fallback token: a SentencePiece decoder replaces a whole run of those with
    U+FFFDs when a stray byte ends it, or a character is cut short at its end, text far before the new ids. So
    while the ids end in such a run, a tokenizer whose decoder is known to do just that (decodes_byte_runs_whole)
    has the run's text made from its bytes (_ByteRun), checked against the decode at the run's first calls, and
    the run is decoded once more when it ends: a long run of characters spelled in bytes (Chinese, emoji, on a
    vocabulary without them) costs its length, not its length at every token. What else the decoders we know do
    across a cut (a byte-level character completed, a first space stripped, a space cleaned up before ".") reaches
    no further back than the context's text, which then does not begin the text decoded after it: the whole run is
    decoded again. To keep that rare, no cut is made after a text that ends in U+FFFD (a character still
    incomplete) or, for a tokenizer that cleans up spaces, with a space in its last 3 characters (the clean-up's
    patterns begin with a space and are up to 4 long)."""

    def __init__(self, tokenizer: Any, ids: list[int], start: int) -> None:
        self.tokenizer, self.ids, self.start = tokenizer, ids, start
        self.cut, self.head = start, ""  # decode(ids[start:cut]) == head, whatever ids come after cut
        self._spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._byte_runs = decodes_byte_runs_whole(tokenizer)
        self._strips = start_strips(tokenizer) if self._byte_runs else ()  # what the decoder takes off the start
        self._run: _ByteRun | None = None  # the byte run the ids end in, while its text is made from its bytes
        self._unmade: _ByteRun | None = None  # the byte run the ids end in, where its text did not check out

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=False)

    def text(self) -> str:
        end, run = len(self.ids), self._run
        if run is not None and self._grow(run, end):
            if run.checks == 0 or not run.whole:  # all U+FFFD: nothing a decoder does at the start applies
                return run.text()
            run.checks -= 1
            text = self._decoded(end)
            if text != run.text():
                self._run, self._unmade = None, run
            return text
        self._run = None
        if self._unmade is not None and not self._grow(self._unmade, end):
            self._unmade = None
        text = self._decoded(end)
        if self._byte_runs and self._unmade is None:
            self._start_run(end, text)
        return text

    def _grow(self, run: _ByteRun, end: int) -> bool:
        """Push ids[run.end:end] into the run; False when one of them is no byte-fallback token (the run ended)."""
        for token in self.tokenizer.convert_ids_to_tokens(self.ids[run.end:end]) if end > run.end else []:
            byte = byte_fallback_value(token)
            if byte is None:
                return False
            run.push(byte)
        return True

    def _start_run(self, end: int, text: str) -> None:
        """Where the ids end in byte-fallback tokens (found once per run, looking back from the end): make the run's
        text from its bytes from now on, if that gives the decoded `text`."""
        start = end
        while start > self.start and is_byte_fallback(self.tokenizer.convert_ids_to_tokens(self.ids[start - 1])):
            start -= 1
        if start == end:
            return
        run = _ByteRun(start, self._decoded(start), self._strips if start == self.start else ())
        self._grow(run, end)
        if run.text() == text:
            self._run = run
        else:
            self._unmade = run

    def _decoded(self, end: int) -> str:
        context = max(self.start, self.cut - STREAM_CONTEXT_IDS)
        before, after = self._decode(context, self.cut), self._decode(context, end)
        text = self.head + after[len(before):] if after.startswith(before) else self._decode(self.start, end)
        if end > self.cut and not text.endswith(UNFINISHED_CHARACTER) and (not self._spaces or " " not in text[-3:]) \
                and not is_byte_fallback(self.tokenizer.convert_ids_to_tokens(self.ids[end - 1])):
            self.cut, self.head = end, text
        return text


class DeltaStream:
    """The deltas of a streamed reply: reasoning_content, content and whole tool calls, each sent once, so that
    the deltas joined are the message ReplyReader.message gives for the final ids. While the reply is unfinished,
    what may still change is held back: an unclosed call, a character still being generated, the format's
    trailing newlines and the end of the content where a stop string may begin. What is a thought, a call or
    content is parse_assistant_ids's rule alone (an unclosed call is its `unfinished` reading): a think block still
    open reads as reasoning, so a thought streams as it is generated, and every prefix reads as the start of the
    whole reply.

    Each call reads only the ids generated since the call before (`generated` must extend the ids it was given
    then): the reading's settled parts (ReplyLayout's: a thought ended, content before an opener, a closed call)
    are read once, and the open one at the end is decoded from its last cut on (_RunText), so a reply costs its
    length in all, not its length at every token. The final call reads the whole reply once, as
    ReplyReader.message does."""

    def __init__(self, reader: ReplyReader) -> None:
        self.reader = reader
        self.reasoning, self.content, self.calls = "", "", 0
        self._layout = ReplyLayout(reader.tokenizer)
        self._layout.push(reader.prefix)
        self._names = set(reader.tool_names)
        self._given = 0  # the generated ids pushed into the layout
        self._settled = 0  # the layout's settled spans read into the fields below
        self._reasoning, self._content, self._calls = "", "", []  # the settled spans' reading (content not stripped)
        self._tail: _RunText | None = None  # the open span's text

    def read(self, generated: Sequence[int], end: int) -> tuple[str, str, list[dict]]:
        """parse_assistant_ids(prefix + generated[:end], unfinished=True)'s fields, reading the new ids only."""
        if end < self._given:
            raise ValueError(f"DeltaStream.read: {end} ids after {self._given}; the ids of a stream only grow")
        layout = self._layout
        layout.push(generated[self._given:end])
        self._given = end
        for span in layout.settled[self._settled:]:
            kind, value = read_span(self.reader.tokenizer, layout.ids, span, self._names)
            if kind == REASONING:
                self._reasoning = value.strip("\n")
            elif kind == CALL:
                self._calls.append(value)
            else:
                self._content += value
        self._settled = len(layout.settled)
        span, reasoning, tail = layout.tail(unfinished=True), self._reasoning, ""
        if span is not None:
            if self._tail is None or self._tail.start != span.start:
                self._tail = _RunText(self.reader.tokenizer, layout.ids, span.start)
            if span.kind == REASONING:
                reasoning = self._tail.text().strip("\n")
            else:
                tail = self._tail.text()
        return (self._content + tail).strip("\n"), reasoning, self._calls

    def _partial(self, generated: Sequence[int], end: int) -> tuple[str, str, list[dict]]:
        content, reasoning, calls = self.reader.cut(*self.read(generated, end))
        hold = max((len(s) - 1 for s in self.reader.stop), default=0)
        content = content.rstrip(UNFINISHED_CHARACTER)
        # max(0, ...): content shorter than the hold is all held (a negative end would cut from the right)
        return content[:max(0, len(content) - hold)], reasoning.rstrip(UNFINISHED_CHARACTER), calls

    def deltas(self, generated: Sequence[int], final: bool = False, end: int | None = None) -> list[dict[str, Any]]:
        """The deltas the ids generated so far, generated[:end] (all by default), add (final: the reply is
        complete). `end` lets a caller pass the list the engine appends to, uncopied: a copy per token would cost
        the reply's length at every token again."""
        end = len(generated) if end is None else end
        if final:
            content, reasoning, calls = self.reader.fields(generated[:end])
        else:
            content, reasoning, calls = self._partial(generated, end)
        out: list[dict[str, Any]] = []
        if reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            out.append({"reasoning_content": reasoning[len(self.reasoning):]})
            self.reasoning = reasoning
        if content.startswith(self.content) and len(content) > len(self.content):
            out.append({"content": content[len(self.content):]})
            self.content = content
        for index, call in enumerate(self.reader.wire_calls(calls[self.calls:], self.calls), self.calls):
            out.append({"tool_calls": [{"index": index, **call}]})
        self.calls = max(self.calls, len(calls))
        return out
