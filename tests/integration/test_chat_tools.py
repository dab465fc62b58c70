"""The chat tool loop (model/chat_session.py, eval/chat.py) with a tiny model trained, full-batch, on the built-in
tools' prompt (tests/tool_model.py's chat_rows, in the model the tool tests share): it calls the calculator for "What is
2+3?" and answers after the response, answers plainly when no tools are offered, calls a tool that does not exist, calls
again and again for "Loop.", and thinks when asked. The prompts the loop sends are compared with the library's encoder
run on the conversation written out here."""

from __future__ import annotations

import io
import sys

import pytest

from dataset.chat_format import tool_call_span
from dataset.tools import TOOLS, Tool, run_tool, tool_schemas
from model.chat_session import ChatSession
from model.generation import GenerationEngine, GenerationSettings
from tests.tool_model import LOOP_CALL, MAGIC_ANSWER, PLAIN_ANSWER, THOUGHT, THOUGHT_ANSWER, called
from tests.tool_model import SUM_ANSWER as ANSWER
from tests.tool_model import SUM_ASK as ASK
from tests.tool_model import SUM_CALL as CALL

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = ["--temperature", "0", "--max_new_tokens", "40"]


@pytest.fixture(scope="module")
def loaded(tool_model):
    from model.loading import load_model

    return load_model(tool_model, device="cpu", dtype="float32")


def session(loaded, **kwargs) -> ChatSession:
    model, tokenizer = loaded
    return ChatSession(model, tokenizer, True, settings=GenerationSettings(max_new_tokens=40, temperature=0.0),
                       **{"tools": tool_schemas(), **kwargs})


@pytest.fixture
def prompts(monkeypatch) -> list[list[int]]:
    """The prompt ids of every generation the chat runs, in order."""
    sent: list[list[int]] = []
    original = GenerationEngine.generate

    def recording(self, prompt_ids, settings, on_text=None):
        sent.append(list(prompt_ids))
        return original(self, prompt_ids, settings, on_text)

    monkeypatch.setattr(GenerationEngine, "generate", recording)
    return sent


def chat(monkeypatch, capsys, tool_model, *args: str, stdin: str = "") -> str:
    """eval/chat.py's main() in this process; its stdout."""
    from eval import chat as chat_tool

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = chat_tool.main(["--model_path", str(tool_model), *GREEDY, *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_the_cli_shows_the_call_its_result_and_the_answer(monkeypatch, capsys, tool_model, tokenizer,
                                                          prompts) -> None:
    from dataset.chat_format import encode_chatml

    out = chat(monkeypatch, capsys, tool_model, "--prompt", "What is 2+3?")
    assert out == f'[tool] calculator({{"expression": "2+3"}}) -> {2 + 3}\n{ANSWER}\n'
    # Two generations: the question with the tools, then the same conversation with the call and its result.
    tools = tool_schemas()
    assert prompts == [encode_chatml(tokenizer, ASK, add_generation_prompt=True, tools=tools).input_ids,
                       encode_chatml(tokenizer, called(ASK, CALL), add_generation_prompt=True, tools=tools).input_ids]
    # Piped lines go through the same loop (the history then holds the whole first exchange).
    out = chat(monkeypatch, capsys, tool_model, "--no_stream", stdin="What is 2+3?\n")
    assert out == f'[tool] calculator({{"expression": "2+3"}}) -> 5\n{ANSWER}\n'


def test_no_tools_sends_a_prompt_without_tools_and_answers_plainly(monkeypatch, capsys, tool_model, tokenizer,
                                                                   prompts) -> None:
    from dataset.chat_format import encode_chatml

    out = chat(monkeypatch, capsys, tool_model, "--prompt", "What is 2+3?", "--no_tools")
    assert out == f"{PLAIN_ANSWER}\n"
    assert prompts == [encode_chatml(tokenizer, ASK, add_generation_prompt=True).input_ids]
    assert "# Tools" not in tokenizer.decode(prompts[0])


def test_thinking_is_shown_before_the_answer(monkeypatch, capsys, tool_model) -> None:
    out = chat(monkeypatch, capsys, tool_model, "--prompt", "Think first.", "--think")
    assert out == f"[think] {THOUGHT}\n{THOUGHT_ANSWER}\n"


def test_the_history_keeps_the_whole_exchange(loaded) -> None:
    chat_session = session(loaded)
    reply = chat_session.reply("What is 2+3?")
    assert reply.text == ANSWER and reply.stopped_at_eos
    assert chat_session.history == called(ASK, CALL) + [{"role": "assistant", "content": ANSWER}]
    assert "<tool_response>5</tool_response>" in chat_session.render("And 3+4?")


def test_an_unknown_tool_gets_an_error_back(loaded) -> None:
    chat_session = session(loaded)
    reply = chat_session.reply("Use magic.")
    [first, last] = reply.rounds
    [result] = first.results
    assert result.name == "magic" and result.result.startswith("Error: unknown tool 'magic'")
    assert chat_session.history[2] == {"role": "tool", "content": result.result}
    assert reply.text == MAGIC_ANSWER and not last.results


def test_a_tool_that_raises_gets_an_error_back(loaded, monkeypatch) -> None:
    def broken(expression: str) -> str:
        raise ZeroDivisionError("a bug in the tool")

    monkeypatch.setitem(TOOLS, "calculator", Tool(TOOLS["calculator"].schema, broken))
    chat_session = session(loaded)
    reply = chat_session.reply("What is 2+3?")
    assert reply.rounds[0].results[0].result == "Error: calculator failed (ZeroDivisionError)"
    assert chat_session.history[2] == {"role": "tool", "content": "Error: calculator failed (ZeroDivisionError)"}


@pytest.mark.parametrize("bound", [3, 1, 0])
def test_the_loop_stops_at_the_bound(loaded, bound) -> None:
    chat_session = session(loaded, max_tool_rounds=bound)
    reply = chat_session.reply("Loop.")
    assert [len(r.results) for r in reply.rounds] == [1] * bound + [0]
    assert reply.rounds[-1].unrun == [LOOP_CALL]  # it called once more; that call was not run
    assert [m["role"] for m in chat_session.history].count("tool") == bound


def test_the_cli_says_when_a_call_is_not_run(monkeypatch, capsys, tool_model) -> None:
    out = chat(monkeypatch, capsys, tool_model, "--prompt", "Loop.")
    lines = out.splitlines()
    assert lines[:3] == ['[tool] calculator({"expression": "1+1"}) -> 2'] * 3
    assert lines[3].startswith("[tool] calculator: not run")


def test_tools_picks_the_offered_tools(monkeypatch, capsys, tool_model, tokenizer, prompts) -> None:
    from dataset.chat_format import encode_chatml
    from eval.chat import build_parser

    chat(monkeypatch, capsys, tool_model, "--prompt", "What is 2+3?", "--tools", "calculator", "--max_new_tokens", "1")
    only = tool_schemas(["calculator"])
    assert prompts[0] == encode_chatml(tokenizer, ASK, add_generation_prompt=True, tools=only).input_ids
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tools", "calculator,magic"])
    assert "unknown tool magic; allowed: wiki, calculator, convert_units" in capsys.readouterr().err



def test_a_sampled_reply_spells_its_call_greedily(loaded) -> None:
    """Sampled hot (temperature 1.5), the memorized model still opens its reply with its call for "What is 2+3?" on
    nearly every seed; by default the call's JSON is then decoded greedily and is exactly the call it learned every
    time, while drawn (greedy_tool_calls=False) it is mostly misspelled. The CLI's --sampled_tool_calls turns it
    off."""
    model, tokenizer = loaded
    opening = tool_call_span(tokenizer)[0]
    outcomes = {}
    for greedy in (True, False):
        opened = exact = 0
        for seed in range(16):
            settings = GenerationSettings(max_new_tokens=40, temperature=1.5, top_p=1.0, seed=seed)
            chat_session = ChatSession(model, tokenizer, True, settings=settings, tools=tool_schemas(),
                                       max_tool_rounds=0, greedy_tool_calls=greedy)  # calls read, not run
            assert chat_session.settings.greedy_span == (tool_call_span(tokenizer) if greedy else None)
            reply = chat_session.reply("What is 2+3?")
            # A reply that opens with its call: the call's context is the learned one (a hot draw may babble first,
            # and a call after babble is off what the model learned, greedy or not). One generation: with
            # max_tool_rounds=0 no call is run.
            if reply.token_ids[:1] == [opening]:
                opened += 1
                exact += reply.rounds[0].unrun == [CALL]
        outcomes[greedy] = opened, exact
    (opened, exact), (drawn_opened, drawn_exact) = outcomes[True], outcomes[False]
    assert opened >= 8 and exact == opened
    assert drawn_opened >= 8 and drawn_exact < drawn_opened / 2


def test_the_cli_decodes_calls_greedily_unless_told(monkeypatch, capsys, tool_model, chat_sessions) -> None:
    chat(monkeypatch, capsys, tool_model, "--prompt", "What is 2+3?")
    chat(monkeypatch, capsys, tool_model, "--prompt", "What is 2+3?", "--sampled_tool_calls")
    chat(monkeypatch, capsys, tool_model, "--prompt", "What is 2+3?", "--no_tools")
    span = tool_call_span(chat_sessions[0].tokenizer)
    assert [session.settings.greedy_span for session in chat_sessions] == [span, None, None]


def test_ctrl_c_during_a_tool_call_drops_that_exchange_and_the_session_goes_on(monkeypatch, capsys, tool_model,
                                                                               chat_sessions) -> None:
    from eval import chat as chat_tool

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    calls = {"count": 0}

    def interrupted_once(name: str, arguments: dict) -> str:
        calls["count"] += 1
        if calls["count"] == 1:
            raise KeyboardInterrupt
        return run_tool(name, arguments)

    monkeypatch.setattr("model.chat_session.run_tool", interrupted_once)
    monkeypatch.setattr(sys, "stdin", Terminal("What is 2+3?\nWhat is 2+3?\n"))
    code = chat_tool.main(["--model_path", str(tool_model), *GREEDY])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.err
    assert "(interrupted: that message and its partial answer are not kept in the history)" in captured.err
    assert f'[tool] calculator({{"expression": "2+3"}}) -> 5\n{ANSWER}\n' in captured.out
    (chat_session,) = chat_sessions
    assert [m["role"] for m in chat_session.history] == ["user", "assistant", "tool", "assistant"]  # the 2nd only
