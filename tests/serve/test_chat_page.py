"""The chat page at / in a real headless browser (Debian's chromium + chromium-driver through
Selenium): send messages, see the reply stream in, the reasoning, the stats line; the page
is saved as a screenshot (build/test-screenshots/chat-page.png)."""
import re
import shutil
from pathlib import Path

import pytest

from .test_api import expected_split, expected_text

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1100,900"]
SCREENSHOT = Path(__file__).resolve().parents[2] / "build" / "test-screenshots" / "chat-page.png"
STATS = re.compile(r"^τ \d+\.\d\d · acceptance \d+% · \d+\.\d tok/s · (\d+) tokens$")


@pytest.fixture(scope="module")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("the chat page test needs Debian's chromium and chromium-driver (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    b = webdriver.Chrome(service=Service(driver), options=options)
    yield b
    b.quit()


def wait(browser, script: str, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(lambda b: b.execute_script(script))


def send(browser, text: str, *, thinking: bool, max_tokens: int) -> dict:
    """Types a message and sends it; returns the finished reply's parts and the lengths its
    text had as it grew."""
    by_id = browser.find_element
    box = by_id("id", "thinking")
    if box.is_selected() != thinking:
        box.click()
    tokens = by_id("id", "max-tokens")
    tokens.clear()
    tokens.send_keys(str(max_tokens))
    browser.execute_script("""
        window.grew = [];
        new MutationObserver(() => {
          const last = [...document.querySelectorAll('.msg.assistant')].pop();
          if (last) window.grew.push(last.querySelector('.content').textContent.length
                                     + last.querySelector('.reasoning').textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    by_id("id", "prompt").send_keys(text)
    by_id("id", "send").click()
    wait(browser, "const m = [...document.querySelectorAll('.msg.assistant')].pop(); return m && m.dataset.done;")
    return browser.execute_script("""
        const m = [...document.querySelectorAll('.msg.assistant')].pop();
        return {content: m.querySelector('.content').textContent, reasoning: m.querySelector('.reasoning').textContent,
                reasoningShown: !m.querySelector('details').hidden, stats: m.querySelector('.stats').textContent,
                error: (m.querySelector('.error') || {}).textContent || null, grew: window.grew};""")


@pytest.mark.slow
def test_chat_page_streams_replies_with_stats(browser, server, engine):
    browser.get(server.url + "/")
    wait(browser, "return document.getElementById('model').textContent === 'coder-target-q8_0.gguf';")
    assert not browser.execute_script("return [...document.scripts].some(s => s.src && !s.src.startsWith(location.origin));")

    first = "Write a stack class."
    reply = send(browser, first, thinking=False, max_tokens=40)
    messages = [{"role": "user", "content": first}]
    gen = engine.generate(messages=messages, enable_thinking=False, max_tokens=40)
    assert reply["error"] is None
    assert (reply["reasoning"], reply["content"]) == expected_split(expected_text(engine, gen), prompt_opens_block=False)
    assert not reply["reasoningShown"]
    assert int(STATS.match(reply["stats"]).group(1)) == len(gen.tokens)
    assert len({n for n in reply["grew"] if 0 < n < len(reply["content"])}) >= 2  # arrived in pieces
    first_content = reply["content"]  # the page sends it back as the assistant's turn

    second = "Now add a peek method."
    reply = send(browser, second, thinking=True, max_tokens=30)
    messages += [{"role": "assistant", "content": first_content}, {"role": "user", "content": second}]
    gen = engine.generate(messages=messages, enable_thinking=True, max_tokens=30)
    want_reasoning, want_content = expected_split(expected_text(engine, gen), prompt_opens_block=True)
    assert (reply["reasoning"], reply["content"]) == (want_reasoning, want_content)
    assert reply["reasoningShown"] and STATS.match(reply["stats"])

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(SCREENSHOT))
    assert SCREENSHOT.stat().st_size > 10_000
    print(f"\nchat page screenshot: {SCREENSHOT}")
