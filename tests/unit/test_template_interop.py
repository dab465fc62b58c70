"""The committed Jinja chat template, as other programs use it: transformers' apply_chat_template on tool
conversations as OpenAI's clients and MiniMind's data send them (not pre-normalised) gives exactly MiniNorm's own
encode_chatml ids -- tools, calls with string or object arguments, tool turns, thinking, several tool rounds, the
generation prompt with and without open_thinking. Where Jinja cannot follow (JSON strings it would have to parse),
the template refuses in one line or writes what it was given; both are pinned here."""

from __future__ import annotations

import json

import pytest
from jinja2.exceptions import TemplateError

from dataset.chat_format import encode_chatml, normalize_messages, render_chatml
from tests.tool_conversations import (CONVERSATIONS, LOOK_ALIKE, LOOK_ALIKE_CONVERSATION, RENDERINGS, TOOLS,
                                      conversation, openai_call)

CONTROL_IDS = set(range(1, 9))  # <|im_start|> .. </think> (tests/unit/test_tokenizer.py checks the ids)


@pytest.mark.parametrize("rendering", RENDERINGS)
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_apply_chat_template_ids_equal_encode_chatml(tokenizer, name, rendering):
    messages, tools = conversation(name)
    kwargs = RENDERINGS[rendering]
    theirs = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, **kwargs)["input_ids"]
    messages, tools = conversation(name)
    assert theirs == encode_chatml(tokenizer, messages, tools=tools, **kwargs).input_ids
    # The text too (a mismatch shows here readably).
    messages, tools = conversation(name)
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    assert rendered == render_chatml(messages, tools=tools, **kwargs)[0]


def test_the_conversations_cover_the_format(tokenizer):
    """Each piece of the format occurs in the conversations above, so the equality says something about it."""
    texts = "".join(render_chatml(messages, tools=tools)[0] for messages, tools in map(conversation, CONVERSATIONS))
    for piece in ("# Tools\nwiki(title: string)", '"arguments": {}}', '"arguments": {"title": "Tour Eiffel — Ω',
                  '"nested": {"list": [1, 2.5, "x"]}', "</tool_call>\n<tool_call>", "Let me look.\n<tool_call>",
                  "</tool_response>\n<tool_response>", "<think>\nA power of two", "<|im_start|>system\n# Tools",
                  "<tool_response></tool_response>"):
        assert piece in texts, piece


@pytest.mark.parametrize("field", ["tools", "tool_calls"])
def test_minimind_json_strings_are_refused_by_the_template_in_one_line(tokenizer, field):
    """MiniMind's lines carry tools and tool_calls as JSON strings; Jinja cannot parse them, so the template says
    so instead of rendering characters; parsed (normalize_messages), they render as encode_chatml does."""
    messages = [{"role": "system", "content": "s", "tools": json.dumps(TOOLS)}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "",
                 "tool_calls": json.dumps([{"name": "wiki", "arguments": {"title": "X"}}])}]
    broken = [dict(message) for message in messages]
    if field == "tools":
        broken[2]["tool_calls"] = json.loads(broken[2]["tool_calls"])
        match = r"^tools must be a list of tool schemas, not a JSON string: parse it first$"
    else:
        broken[0]["tools"] = json.loads(broken[0]["tools"])
        match = r"^messages\[2\]\.tool_calls must be a list of calls, not a JSON string: parse it first$"
    with pytest.raises(TemplateError, match=match):
        tokenizer.apply_chat_template(broken, tokenize=False)
    ids = tokenizer.apply_chat_template(normalize_messages(messages), tokenize=True)["input_ids"]
    assert ids == encode_chatml(tokenizer, messages).input_ids


def test_string_arguments_are_written_as_given(tokenizer):
    """Jinja cannot re-serialise a JSON string: arguments sent in another spacing than MiniNorm's (json.dumps'
    ", " and ": ", which its server returns) reach the template's text as they are, while encode_chatml parses and
    re-dumps them. Objects, or strings in that spacing, render identically (the test above)."""
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [openai_call("1", "wiki", '{"title":"X"}')]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert '<tool_call>{"name": "wiki", "arguments": {"title":"X"}}</tool_call>' in rendered
    assert '<tool_call>{"name": "wiki", "arguments": {"title": "X"}}</tool_call>' in render_chatml(messages)[0]


def test_look_alike_tags_become_control_tokens_in_apply_chat_template(tokenizer):
    """The control-token rule is MiniNorm's encoders' (text is encoded as text, control tokens are inserted by id);
    apply_chat_template renders one string and tokenizes it with special tokens parsed, so a "<tool_call>" typed
    in a user message or returned by a tool becomes the control token there. The text is the same; the ids
    differ exactly at the look-alike tags. (llama.cpp does what transformers does: tests/integration/
    test_llama_cpp.py.)"""
    kwargs = {"add_generation_prompt": True}
    theirs_text = tokenizer.apply_chat_template(LOOK_ALIKE_CONVERSATION, tokenize=False, **kwargs)
    assert theirs_text == render_chatml(LOOK_ALIKE_CONVERSATION, **kwargs)[0]
    theirs = tokenizer.apply_chat_template(LOOK_ALIKE_CONVERSATION, tokenize=True, **kwargs)["input_ids"]
    ours = encode_chatml(tokenizer, LOOK_ALIKE_CONVERSATION, **kwargs).input_ids
    look_alike_controls = [i for i in tokenizer(LOOK_ALIKE, add_special_tokens=False)["input_ids"]
                           if i in CONTROL_IDS]
    assert len(look_alike_controls) == 5  # <tool_call> </tool_call> <think> </think> <|im_end|>
    theirs_controls = [i for i in theirs if i in CONTROL_IDS]
    ours_controls = [i for i in ours if i in CONTROL_IDS]
    # The user's copy adds its 5; the tool's adds <tool_response>, its 5 and </tool_response>.
    assert len(theirs_controls) == len(ours_controls) + 2 * 5 + 2
