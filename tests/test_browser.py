"""The chat UI in a real browser: Debian's Chromium driven by Python playwright (headless).

Never runs `playwright install`: it uses /usr/bin/chromium (`apt-get install -y chromium`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from test_launch import rambling, wait_for

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

def set_slider(page, label: str, value: int) -> None:
    """Type `value` into a Gradio slider's number box and wait until the slider itself follows.

    Typing can land before the page's handlers are live (seen on a slow CI machine: the value
    never reached the app), so retype until the range input shows the value.
    """
    from playwright.sync_api import expect

    box = page.get_by_label(f"number input for {label}")
    slider = page.get_by_label(f"range slider for {label}")
    for _ in range(5):
        box.fill(str(value))
        box.press("Tab")
        try:
            expect(slider).to_have_value(str(value), timeout=2000)
            return
        except AssertionError:
            continue
    expect(slider).to_have_value(str(value))


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason="needs Debian's chromium: apt-get install -y chromium"),
]


def test_chat_streams_and_stop_frees_the_slot(tiny_llama_dir):
    from playwright.sync_api import expect, sync_playwright

    from nbserve.serving.launch import launch

    ARTIFACTS.mkdir(exist_ok=True)
    srv = launch(rambling(tiny_llama_dir, delay=0.02), max_batch=2)
    engine = srv.engine
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            try:
                page = browser.new_page(viewport={"width": 1100, "height": 1000})
                page.goto(srv.url)
                expect(page.locator("#nbserve-model")).to_contain_text("tiny-llama")
                page.get_by_text("Model settings").click()
                # 1. a short answer streams in and the speed line shows tokens/s
                set_slider(page, "Max tokens", 30)
                box = page.locator("#nbserve-input textarea")
                box.fill("Hello there")
                box.press("Enter")
                expect(page.locator('[data-testid="user"]').first).to_contain_text("Hello there")
                bot = page.locator('[data-testid="bot"]')
                speed = page.locator("#nbserve-speed")
                expect(speed).to_contain_text("Last answer: 30 tokens", timeout=20000)
                expect(speed).to_contain_text("tokens/s")
                assert bot.first.inner_text().strip()

                # 2. a long answer: watch it grow, press Stop, see it end and the slot freed
                set_slider(page, "Max tokens", 480)
                box.fill("Tell me a very long story")
                box.press("Enter")
                seen: list[int] = []
                deadline = time.monotonic() + 20
                while len(set(seen)) < 3 and time.monotonic() < deadline:
                    if bot.count() == 2:
                        seen.append(len(bot.nth(1).inner_text()))
                    time.sleep(0.1)
                assert len({n for n in seen if n}) >= 3, f"no streaming seen: {seen}"
                # 480 tokens after the first turn overflow the 512-token context: the first
                # turn is left out, and a note says so above the answer
                expect(bot.nth(1)).to_contain_text(
                    "(Older turns were left out to fit the model's 512-token context.)")
                assert engine.stats()["running"] == 1
                page.locator('[data-testid="stop-button"]').click()
                wait_for(lambda: engine.stats()["running"] == 0, 10, "the slot to be freed")
                assert engine.stats()["requests_finished"].get("cancelled") == 1
                stopped_at = bot.nth(1).inner_text()
                time.sleep(0.8)
                assert bot.nth(1).inner_text() == stopped_at  # nothing more arrives
                expect(box).to_be_editable()
                expect(speed).to_contain_text("stopped", timeout=10000)
                page.screenshot(path=str(ARTIFACTS / "chat_ui.png"), full_page=True)
            finally:
                browser.close()
    finally:
        srv.stop()


def test_compare_two_models_side_by_side_and_pick_one(tmp_path):
    """Several models: the picker answers with the chosen one; the Compare accordion sends one
    prompt to two models and streams both answers, each with its tokens and speed."""
    from playwright.sync_api import expect, sync_playwright
    from tiny_models import make_tiny_hf_dir

    from nbserve.serving.launch import launch

    ARTIFACTS.mkdir(exist_ok=True)
    alpha = make_tiny_hf_dir(tmp_path / "alpha", arch="llama")
    beta = make_tiny_hf_dir(tmp_path / "beta", arch="qwen2", tie=False, seed=1)
    srv = launch({"alpha": str(alpha), "beta": str(beta)}, max_batch=4, max_context=256)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 1400})
                page.goto(srv.url)
                picker = page.locator("#nbserve-picker")
                expect(picker).to_be_visible()
                # 1. the picker: beta answers the chat (it loads on this first request)
                picker.locator("input").click()
                page.get_by_role("option", name="beta").click()
                box = page.locator("#nbserve-input textarea")
                box.fill("Hello there")
                box.press("Enter")
                speed = page.locator("#nbserve-speed")
                expect(speed).to_contain_text("tokens/s", timeout=30000)
                assert [m.state for m in srv.models] == ["loaded", "loaded"]
                # 2. side by side
                page.get_by_text("Compare two models side by side").click()
                page.locator("#nbserve-compare-prompt textarea").fill("Tell me a story")
                page.locator("#nbserve-compare-send").click()
                line_a = page.locator("#nbserve-compare-a-speed")
                line_b = page.locator("#nbserve-compare-b-speed")
                for line, name in ((line_a, "alpha"), (line_b, "beta")):
                    expect(line).to_contain_text(f"{name}: ", timeout=30000)
                    expect(line).to_contain_text("tokens/s")
                    expect(line).not_to_contain_text("answering", timeout=30000)
                assert page.locator("#nbserve-compare-a").inner_text().strip()
                assert page.locator("#nbserve-compare-b").inner_text().strip()
                page.screenshot(path=str(ARTIFACTS / "compare_ui.png"), full_page=True)
            finally:
                browser.close()
    finally:
        srv.stop()
