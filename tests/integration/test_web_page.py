"""The chat page (scripts/web/) in a real browser: Debian's Chromium, headless, driven by Playwright with the
system browser (never a downloaded build). Install it with `apt-get install -y chromium`; .ci/run does.
Screenshots go to the test's temp folder, or to $MININORM_SCREENSHOTS when set. The tool loop runs against a tiny
model trained, full-batch, to make fixed tool calls and answer a fixed way after the tool's real result."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from tests.paths import REPO
from tests.tool_model import BAD_CALL_TEXT, THOUGHT, THOUGHT_ANSWER, WIKI_ANSWER, WIKI_ASK, WIKI_CALL

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
WEB = REPO / "scripts" / "web"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import expect, sync_playwright

    # expect() waits 5 s by default, its own setting apart from the page's: on a loaded 2-core machine a reply can
    # take longer, so its assertions wait as long as the page's actions do.
    expect.set_options(timeout=TIMEOUT_MS)
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no browser at {CHROMIUM}: apt-get install -y chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 900, "height": 700})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert errors == []  # no JavaScript error on the page


def screenshot(page, tmp_path: Path, name: str, full_page: bool = True) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    if os.environ.get("MININORM_SCREENSHOTS"):
        target = Path(os.environ["MININORM_SCREENSHOTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / path.name)
    assert path.stat().st_size > 1000
    return path


def sent_messages(request) -> list[dict]:
    return json.loads(request.post_data)["messages"]


def ask(page, text: str):
    """Type a message, press Enter; the chat request the page sent."""
    page.fill("#input", text)
    with page.expect_request("**/v1/chat/completions") as request:
        page.press("#input", "Enter")
    return request.value


def test_page_works_offline_from_the_repository() -> None:
    for name in ("index.html", "chat.js", "chat.css"):
        text = (WEB / name).read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name


def test_chat_streams_answers_keeps_history_and_resets(page, serve_app, threaded_server, tiny_models,
                                                       tmp_path) -> None:
    """The tiny chat model (it learned two-turn conversations too) answers every turn with its reply."""
    from playwright.sync_api import expect

    with threaded_server(serve_app(tiny_models.chat)) as server:
        page.goto(server.url)
        expect(page.locator("#model-name")).to_contain_text(tiny_models.chat.name)
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "40")
        first = ask(page, "Who are you?")
        answers = page.locator(".message.assistant")
        expect(answers).to_have_count(1)
        expect(answers.nth(0)).to_have_text(tiny_models.reply)
        expect(page.locator("#stats")).to_contain_text("tokens/s")
        body = json.loads(first.post_data)
        assert body["stream"] is True and body["temperature"] == 0 and body["max_tokens"] == 40
        assert "frequency_penalty" not in body  # left empty: the server's default
        assert sent_messages(first) == [{"role": "user", "content": "Who are you?"}]

        second = ask(page, "Hi!")  # multi-turn: the whole conversation goes with the request
        expect(answers).to_have_count(2)
        expect(answers.nth(1)).to_have_text(tiny_models.reply)
        assert sent_messages(second) == [{"role": "user", "content": "Who are you?"},
                                         {"role": "assistant", "content": tiny_models.reply},
                                         {"role": "user", "content": "Hi!"}]
        expect(page.locator(".message.user")).to_have_text(["Who are you?", "Hi!"])
        screenshot(page, tmp_path, "chat_page")

        page.click("#reset")
        expect(page.locator(".message")).to_have_count(0)
        third = ask(page, "Hello")
        assert sent_messages(third) == [{"role": "user", "content": "Hello"}]  # the history is gone
        expect(answers.nth(0)).to_have_text(tiny_models.reply)


def test_the_answer_is_rendered_while_it_streams(page, endless_model, serve_app, threaded_server,
                                                 tmp_path) -> None:
    """A 150-token answer from a model that never ends its turn: the page shows it growing, piece by piece, and
    ends with exactly the text the API gives for the same request; markup in an answer is shown as text."""
    from playwright.sync_api import expect

    with threaded_server(serve_app(endless_model)) as server:
        page.goto(server.url)
        expect(page.locator("#model-name")).to_contain_text("context 4096")
        page.fill("#temperature", "0")
        page.fill("#frequency-penalty", "0.5")
        page.fill("#max-tokens", "150")
        page.evaluate("""() => {
            window.seenLengths = [];
            new MutationObserver(() => {
                const answer = document.querySelector('.message.assistant');
                if (answer) window.seenLengths.push(answer.textContent.length);
            }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
        }""")
        sent = json.loads(ask(page, "<b>Tell</b> me <|im_end|> a long story").post_data)
        answer = page.locator(".message.assistant")
        expect(answer).to_have_attribute("data-finish", "length")
        expect(page.locator(".message.user b")).to_have_count(0)  # the user's markup stays text
        expect(page.locator("#stats")).to_contain_text("150 tokens")
        screenshot(page, tmp_path, "streamed_answer", full_page=False)
        lengths = page.evaluate("window.seenLengths")
        final = answer.text_content()
        assert len(set(lengths)) >= 5 and max(lengths) == len(final)  # it grew in several steps
        assert sent["messages"] == [{"role": "user", "content": "<b>Tell</b> me <|im_end|> a long story"}]
        assert (sent["temperature"], sent["frequency_penalty"], sent["max_tokens"]) == (0, 0.5, 150)  # and tools
        whole = {key: value for key, value in sent.items() if key not in ("stream", "stream_options")}
        expected = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                              json=whole).json()["choices"][0]["message"]["content"]
        assert final == expected

        # Stop: a long answer is cut where it is, and the page goes on working.
        page.fill("#max-tokens", "3000")
        ask(page, "Another one")
        expect(page.locator("#stop")).to_be_visible()
        page.wait_for_function("document.querySelectorAll('.message.assistant')[1].textContent.length > 10")
        page.locator("#stop").dispatch_event("click")  # the button, wherever the growing answer has scrolled it
        expect(answer.nth(1)).to_have_attribute("data-finish", "stopped")
        expect(page.locator("#send")).to_be_enabled()


def test_a_model_load_that_ends_late_leaves_a_chat_error_shown(page, sft_server) -> None:
    """The page loads the model's name, then the server's tools; a question sent before they arrive (a slow or busy
    server) and refused keeps its error: the load's end clears only the load's own message (it cleared any)."""
    from playwright.sync_api import expect

    held = []
    page.route("**/tools", lambda route: held.append(route))  # the tools request waits here until let go
    page.goto(sft_server)
    expect(page.locator("#model-name")).to_contain_text("context")
    page.fill("#temperature", "5")
    ask(page, "Who are you?")
    error = page.locator("#error")
    expect(error).to_contain_text("400")
    assert len(held) == 1
    held[0].continue_()
    # the tools' answer retitles their switch; the load ends in the same turn of the page's event loop
    expect(page.locator("#tools-label")).not_to_have_attribute("title", "let the model call the server's tools")
    expect(error).to_be_visible()
    expect(error).to_contain_text("400")


def test_server_errors_are_shown_in_the_page(page, sft_server, tmp_path) -> None:
    from playwright.sync_api import expect

    page.goto(sft_server)
    page.fill("#temperature", "5")
    ask(page, "Who are you?")
    error = page.locator("#error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("400")
    expect(error).to_contain_text("temperature")
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#input")).to_have_value("Who are you?")  # the question waits to be sent again
    screenshot(page, tmp_path, "error_shown")
    page.fill("#temperature", "0")
    page.press("#input", "Enter")
    expect(page.locator(".message.assistant")).to_have_count(1)
    expect(error).to_be_hidden()


def test_the_page_asks_for_the_api_key(page, tiny_models, serve_app, threaded_server, tmp_path) -> None:
    from playwright.sync_api import expect

    with threaded_server(serve_app(tiny_models.sft, api_key="s3cret")) as server:
        page.goto(server.url)
        expect(page.locator("#error")).to_contain_text("401")
        expect(page.locator("#api-key")).to_be_visible()
        page.fill("#api-key", "s3cret")
        page.dispatch_event("#api-key", "change")
        expect(page.locator("#model-name")).to_contain_text(tiny_models.sft.name)
        page.fill("#temperature", "0")
        ask(page, "Hello")
        expect(page.locator(".message.assistant")).to_have_text(tiny_models.reply)


# ---------------------------------------------------------------------------------------------------- the tool loop
class Recorder:
    """An ASGI app around the server's: the JSON body of every chat request the server receives, in order."""

    def __init__(self, app) -> None:
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def receiving():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(json.loads(b"".join(chunks)))
            return message

        return await self.app(scope, receiving, send)


@pytest.fixture(scope="module")
def tool_server(tool_model, serve_app, threaded_server):
    """The server of the shared tool model (tests/tool_model.py's page_rows); yields (its URL, the Recorder)."""
    recorder = Recorder(serve_app(tool_model, max_batch=1))
    with threaded_server(recorder) as server:
        yield server.url, recorder


def open_page(page, url: str) -> None:
    from playwright.sync_api import expect

    page.goto(url)
    expect(page.locator("#tools")).to_be_checked()  # the server offers tools: on by default
    expect(page.locator("#think")).not_to_be_checked()
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "40")


def wire_call(call: dict, call_id: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}


def test_a_tool_call_is_shown_run_and_answered(page, tool_server, tmp_path) -> None:
    """The model calls wiki: the page shows the call and the (long, so collapsed) result, runs the tool through the
    server, sends the call and the result back, and shows the answer; the history keeps the whole exchange."""
    from playwright.sync_api import expect

    from dataset.tools import run_tool, tool_schemas

    url, recorder = tool_server
    open_page(page, url)
    start = len(recorder.bodies)
    ask(page, "What is Paris?")
    expect(page.locator(".message.assistant .content")).to_have_text(WIKI_ANSWER)
    tool = page.locator(".message.tool")
    expect(tool).to_have_count(1)
    expect(tool.locator(".tool-call")).to_have_text('wiki({"title": "Paris"})')
    summary = run_tool("wiki", {"title": "Paris"})
    assert len(summary) > 120
    result = tool.locator("details.tool-result")
    expect(result).not_to_have_attribute("open", re.compile(".*"))  # collapsed
    expect(result.locator(".tool-result-text")).to_be_hidden()
    assert result.locator(".tool-result-text").text_content() == summary
    expect(page.locator("#stats")).to_contain_text("1 tool call")
    roles = page.eval_on_selector_all("#messages > *", "nodes => nodes.map(n => n.className)")
    assert roles == ["message user", "message tool", "message assistant"]  # no empty bubble for the call
    screenshot(page, tmp_path, "tool_call")
    result.locator("summary").click()
    expect(result.locator(".tool-result-text")).to_be_visible()

    # What the server received: the question with the tools, then the call as the server sent it and the result.
    first, second = recorder.bodies[start:]
    assert first["messages"] == WIKI_ASK and first["tools"] == tool_schemas() and "chat_template_kwargs" not in first
    [call] = second["messages"][1]["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert second["messages"] == WIKI_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [wire_call(WIKI_CALL, call["id"])]},
        {"role": "tool", "tool_call_id": call["id"], "content": summary}]
    assert second["tools"] == tool_schemas()

    ask(page, "Think first.")  # the next message carries the whole exchange
    expect(page.locator("#send")).to_be_enabled()  # answered: the server has the request
    assert recorder.bodies[-1]["messages"] == second["messages"] + [
        {"role": "assistant", "content": WIKI_ANSWER}, {"role": "user", "content": "Think first."}]


def test_thinking_is_shown_collapsed_above_the_answer(page, tool_server, tmp_path) -> None:
    from playwright.sync_api import expect

    url, recorder = tool_server
    open_page(page, url)
    page.check("#think")
    request = ask(page, "Think first.")
    assert json.loads(request.post_data)["chat_template_kwargs"] == {"open_thinking": True}
    answer = page.locator(".message.assistant")
    expect(answer.locator(".content")).to_have_text(THOUGHT_ANSWER)
    thinking = answer.locator("details.thinking")
    expect(thinking).to_have_count(1)
    assert thinking.get_attribute("open") is None
    expect(thinking.locator(".thinking-text")).to_be_hidden()
    assert thinking.locator(".thinking-text").text_content() == THOUGHT
    assert answer.evaluate("div => div.firstElementChild.tagName") == "DETAILS"  # above the answer
    thinking.locator("summary").click()
    expect(thinking.locator(".thinking-text")).to_be_visible()
    screenshot(page, tmp_path, "thinking")
    assert recorder.bodies[-1]["messages"] == [{"role": "user", "content": "Think first."}]
    ask(page, "Hello")
    expect(page.locator("#send")).to_be_enabled()
    assert recorder.bodies[-1]["messages"][1] == {"role": "assistant", "content": THOUGHT_ANSWER,
                                                  "reasoning_content": THOUGHT}


def test_a_badly_written_call_is_shown_as_text(page, tool_server) -> None:
    from playwright.sync_api import expect

    url, recorder = tool_server
    open_page(page, url)
    start = len(recorder.bodies)
    ask(page, "Break it.")
    answer = page.locator(".message.assistant .content")
    expect(answer).to_have_text(f"<tool_call>{BAD_CALL_TEXT}</tool_call>")
    assert answer.evaluate("node => node.children.length") == 0  # text, not markup
    expect(page.locator(".message.tool")).to_have_count(0)
    expect(page.locator("#send")).to_be_enabled()
    assert len(recorder.bodies) == start + 1  # nothing was run, nothing asked again


def test_the_loop_stops_at_the_round_limit(page, tool_server) -> None:
    """A model that calls the calculator again and again: three rounds run (the server's max_tool_rounds), the
    fourth call is shown, not run, and the history keeps no unanswered call."""
    from playwright.sync_api import expect

    from model.chat_session import MAX_TOOL_ROUNDS

    url, recorder = tool_server
    open_page(page, url)
    start = len(recorder.bodies)
    ask(page, "Loop.")
    tools = page.locator(".message.tool")
    expect(tools).to_have_count(MAX_TOOL_ROUNDS + 1)
    expect(tools.nth(MAX_TOOL_ROUNDS).locator(".tool-note")).to_contain_text(f"not run: at most {MAX_TOOL_ROUNDS}")
    expect(page.locator("#send")).to_be_enabled()
    for index in range(MAX_TOOL_ROUNDS):
        expect(tools.nth(index)).to_have_text('calculator({"expression": "1+1"})→ 2')
    sent = recorder.bodies[start:]
    assert len(sent) == MAX_TOOL_ROUNDS + 1
    assert [len(body["messages"]) for body in sent] == [1, 3, 5, 7]
    assert [m["role"] for m in sent[-1]["messages"]] == ["user"] + ["assistant", "tool"] * MAX_TOOL_ROUNDS
    ask(page, "Hello")
    expect(page.locator("#send")).to_be_enabled()
    assert recorder.bodies[-1]["messages"][7] == {"role": "assistant", "content": ""}  # the unrun call is left out


def test_tools_off_sends_no_tools(page, tool_server) -> None:
    from playwright.sync_api import expect

    url, recorder = tool_server
    open_page(page, url)
    page.uncheck("#tools")
    request = ask(page, "What is Paris?")
    assert "tools" not in json.loads(request.post_data)
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator(".message.assistant")).to_have_count(1)
    expect(page.locator(".message.tool")).to_have_count(0)


def test_the_tools_switch_is_off_where_the_server_offers_none(page, tiny_models, serve_app, threaded_server) -> None:
    """The tiny SFT model's 128-token context cannot hold the tools' descriptions: the switch is off, disabled,
    and says why."""
    from playwright.sync_api import expect

    with threaded_server(serve_app(tiny_models.sft, max_batch=1)) as server:
        page.goto(server.url)
        expect(page.locator("#model-name")).to_contain_text(tiny_models.sft.name)
        expect(page.locator("#tools")).to_be_disabled()
        expect(page.locator("#tools")).not_to_be_checked()
        expect(page.locator("#tools-label")).to_have_attribute("title", re.compile("context is 128"))
