"""The chat page (scripts/web/) in a real browser: Debian's Chromium, headless, driven by Playwright with the
system browser (never a downloaded build). Install it with `apt-get install -y chromium`; .ci/run does.
Screenshots go to the test's temp folder, or to $MININORM_SCREENSHOTS when set."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from tests.paths import REPO

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
WEB = REPO / "scripts" / "web"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

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
        page.fill("#max-tokens", "150")
        page.evaluate("""() => {
            window.seenLengths = [];
            new MutationObserver(() => {
                const answer = document.querySelector('.message.assistant');
                if (answer) window.seenLengths.push(answer.textContent.length);
            }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
        }""")
        ask(page, "<b>Tell</b> me <|im_end|> a long story")
        answer = page.locator(".message.assistant")
        expect(answer).to_have_attribute("data-finish", "length")
        expect(page.locator(".message.user b")).to_have_count(0)  # the user's markup stays text
        expect(page.locator("#stats")).to_contain_text("150 tokens")
        screenshot(page, tmp_path, "streamed_answer", full_page=False)
        lengths = page.evaluate("window.seenLengths")
        final = answer.text_content()
        assert len(set(lengths)) >= 5 and max(lengths) == len(final)  # it grew in several steps
        expected = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "<b>Tell</b> me <|im_end|> a long story"}],
            "temperature": 0, "max_tokens": 150}).json()["choices"][0]["message"]["content"]
        assert final == expected

        # Stop: a long answer is cut where it is, and the page goes on working.
        page.fill("#max-tokens", "3000")
        ask(page, "Another one")
        expect(page.locator("#stop")).to_be_visible()
        page.wait_for_function("document.querySelectorAll('.message.assistant')[1].textContent.length > 10")
        page.locator("#stop").dispatch_event("click")  # the button, wherever the growing answer has scrolled it
        expect(answer.nth(1)).to_have_attribute("data-finish", "stopped")
        expect(page.locator("#send")).to_be_enabled()


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
