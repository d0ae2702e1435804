"""The chat page in a real headless browser: Debian's chromium driven by playwright-python (no
browser is downloaded). Sends a message, waits for the streamed reply and the tokens/s line, and
saves a screenshot as a test artifact (BRISK_TEST_ARTIFACTS, default ./test-artifacts)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs a chromium binary (Debian: apt-get install chromium)")

# Flags for a closed network (see the machine notes): no background connections, no sandbox as root.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_chat_page_streams_a_reply(server: dict[str, Any]) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install playwright)")
    artifacts = Path(os.environ.get("BRISK_TEST_ARTIFACTS", "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)  # fresh profile
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.goto(server["base"] + "/")
            page.wait_for_function("document.getElementById('model').textContent === 'smollm2-135m'", timeout=10_000)
            page.click("details summary")  # the settings are folded away
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "24")
            page.fill("#input", "What is the capital of France?")
            page.press("#input", "Enter")
            page.wait_for_function("document.getElementById('stats').textContent.includes('tokens/s')", timeout=60_000)
            user = page.inner_text(".msg.user")
            reply = page.inner_text(".msg.assistant")
            stats = page.inner_text("#stats")
            page.screenshot(path=str(artifacts / "chat_page.png"))
        finally:
            browser.close()
    assert user == "What is the capital of France?"
    assert reply.strip()
    # the page shows what the API returns for the same conversation, greedy
    expected = server["client"].chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0).choices[0].message.content
    assert reply.strip() == expected.strip()
    assert "tokens/s" in stats and (artifacts / "chat_page.png").stat().st_size > 10_000
