"""The /dashboard and /chat pages in a real browser (headless Chromium via Selenium and
Debian's chromedriver; scripts/setup.sh installs them where it can, else these skip).

The HTTP test modules' shared deployment serves both pages. The dashboard watches a replay sent through the HTTP
API and must show its iterations while it runs and, once it is over, the numbers /metrics
has; the chat page streams answers, sends the whole conversation each turn, and its Stop
button frees the request's KV blocks on the server.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from http_fixtures import API_KEY, MODEL, HTTPServer

from sarazmq.replay.openai_driver import replay_openai
from sarazmq.replay.workload import WorkloadSpec, build_workload

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        not (CHROMEDRIVER and CHROMIUM),
        reason="no headless Chromium (Debian's chromium and chromium-driver packages)",
    ),
]


@pytest.fixture(scope="module")
def root(http_server: HTTPServer) -> str:
    return http_server.root  # the HTTP modules' shared deployment (conftest.py)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def api(root: str) -> httpx.Client:
    return httpx.Client(base_url=root, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def wait_for(check: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.1)


def open_with_key(browser: Any, url: str) -> None:
    """Opens a page, which asks for the key (the server answers 401 without it)."""
    browser.get(url)
    browser.execute_script("sessionStorage.clear()")
    browser.get(url)
    form = browser.find_element(By.ID, "key-form")
    wait_for(lambda: "shown" in form.get_attribute("class"), 20, "the key form")
    browser.find_element(By.ID, "key-input").send_keys(API_KEY)
    form.submit()


def metric(text: str, name: str, default: float | None = None) -> float:
    """A sample of /metrics; a labelled counter has none before its first event."""
    m = re.search(rf"^sarazmq:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    if m is None and default is not None:
        return default
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def table_rows(browser: Any) -> list[list[str]]:
    """The recent-iterations table's cells, read at once (the page redraws it often)."""
    return browser.execute_script(
        "return [...document.querySelectorAll('section.engine tbody tr')]"
        ".map((r) => [...r.cells].map((c) => c.textContent))"
    )


def text_of(browser: Any, selector: str) -> str:
    """The element's text, "" while the page has not drawn it yet (waits poll on)."""
    found = browser.find_elements(By.CSS_SELECTOR, selector)
    return found[0].text if found else ""


# ---------------------------------------------------------------- dashboard


def test_dashboard_shows_a_running_replay_and_agrees_with_metrics(root: str, browser: Any) -> None:
    spec = WorkloadSpec(
        vocab_size=49152,
        avoid_ids=(0, 1, 2),
        lengths="uniform",
        input_range=(80, 240),
        output_range=(6, 16),
        arrivals="poisson",
        qps=8.0,
        max_requests=10,
        seed=3,
    )
    requests = build_workload(spec)
    open_with_key(browser, f"{root}/dashboard")
    wait_for(
        lambda: text_of(browser, "section.engine .iterations") not in ("", "-"),
        30,
        "first snapshot",
    )
    with api(root) as client:  # the shared server has served other modules' requests
        before = metric(client.get("/metrics").text, "request_success_total", default=0.0)

    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome["out"] = asyncio.run(
            replay_openai(
                f"{root}/v1", MODEL, requests, api_key=API_KEY, progress=False, warmup=False
            )
        )

    thread = threading.Thread(target=run)
    thread.start()
    try:
        # while it runs: hybrid iterations (a prompt chunk and decodes) appear in the table
        def hybrid_row() -> bool:
            for cells in table_rows(browser):
                if int(cells[1]) > 0 and int(cells[2]) > 0:
                    assert int(cells[1]) + int(cells[2]) <= int(cells[3])  # within the budget
                    return True
            return False

        wait_for(hybrid_row, 120, "a hybrid iteration on the page")
    finally:
        thread.join(timeout=300)
    assert not thread.is_alive()
    records = outcome["out"].records
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]

    with api(root) as client:

        def settled() -> str | None:
            text = client.get("/metrics").text
            finished = metric(text, "request_success_total")
            done = finished == before + len(records)
            idle = metric(text, "num_requests_running") == 0
            shown = text_of(browser, "#finished") == str(int(finished))
            return text if done and idle and shown else None

        text = wait_for(settled, 30, "the page and /metrics to settle")
        time.sleep(1.5)  # one more snapshot after the scrape
        text = client.get("/metrics").text
    assert text_of(browser, "#finished") == str(int(metric(text, "request_success_total")))
    assert text_of(browser, "#output-tokens") == str(int(metric(text, "generation_tokens_total")))
    assert text_of(browser, "section.engine .running") == str(
        int(metric(text, "num_requests_running"))
    )
    assert text_of(browser, "section.engine .waiting") == str(
        int(metric(text, "num_requests_waiting"))
    )
    kv = 100 * metric(text, "kv_cache_usage_perc")
    assert text_of(browser, "section.engine .kv") == f"{kv:.1f} %"
    hits, queries = (
        metric(text, "prefix_cache_hits_total"),
        metric(text, "prefix_cache_queries_total"),
    )
    assert text_of(browser, "section.engine .hits") == f"{int(hits)} / {int(queries)}"
    for card in ("#ttft-p50", "#ttft-p99", "#tbt-p50", "#tbt-p99"):  # a window of requests
        assert re.fullmatch(r"[0-9.]+ m?s", text_of(browser, card)), card
    assert browser.find_element(By.ID, "status").get_attribute("class") == "status live"


def test_dashboard_data_needs_the_key(root: str) -> None:
    with httpx.Client(base_url=root, timeout=30) as anon:
        assert anon.get("/dashboard").status_code == 200  # the page holds no data
        r = anon.get("/dashboard/state")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert anon.get("/dashboard/events").status_code == 401
        assert anon.get("/static/dashboard.js").status_code == 200
        assert anon.get("/static/missing.js").status_code == 404


# ---------------------------------------------------------------- chat


def send(browser: Any, text: str) -> None:
    box = browser.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def assistant_messages(browser: Any) -> list[Any]:
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def test_chat_streams_and_keeps_the_conversation(root: str, browser: Any) -> None:
    open_with_key(browser, f"{root}/chat")
    wait_for(lambda: text_of(browser, "#model") == MODEL, 20, "the model name")
    temperature = browser.find_element(By.ID, "temperature")
    temperature.clear()
    temperature.send_keys("0")
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("24")

    send(browser, "What is the capital of France?")
    wait_for(lambda: assistant_messages(browser)[-1].get_attribute("data-finish"), 60, "answer 1")
    first = assistant_messages(browser)[-1].find_element(By.CLASS_NAME, "text").text
    assert first
    send(browser, "And of Italy?")
    wait_for(
        lambda: (
            len(assistant_messages(browser)) == 2
            and assistant_messages(browser)[-1].get_attribute("data-finish")
        ),
        60,
        "answer 2",
    )
    second = assistant_messages(browser)[-1].find_element(By.CLASS_NAME, "text").text
    # the page sent the whole conversation: the same messages through the API answer the same
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And of Italy?"},
    ]
    body = {"model": MODEL, "messages": messages, "temperature": 0, "top_p": 1, "max_tokens": 24}
    with api(root) as client:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert second == r.json()["choices"][0]["message"]["content"]
    roles = [m.get_attribute("data-role") for m in browser.find_elements(By.CSS_SELECTOR, ".msg")]
    assert roles == ["user", "assistant", "user", "assistant"]


def test_chat_stop_aborts_and_frees_the_kv_blocks(root: str, browser: Any) -> None:
    open_with_key(browser, f"{root}/chat")
    wait_for(lambda: text_of(browser, "#model") == MODEL, 20, "the model name")
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("900")
    browser.find_element(By.ID, "ignore-eos").click()
    send(browser, "Tell me a very long story.")
    with api(root) as client:

        def state() -> dict:
            return client.get("/dashboard/state").json()["engines"][0]

        wait_for(lambda: state()["num_running"] == 1, 30, "the request to run")
        wait_for(
            lambda: (
                len(assistant_messages(browser)[-1].find_element(By.CLASS_NAME, "text").text) > 20
            ),
            60,
            "streamed text",
        )
        assert state()["num_free_blocks"] < state()["num_total_blocks"]
        browser.find_element(By.ID, "stop").click()
        wait_for(
            lambda: assistant_messages(browser)[-1].get_attribute("data-finish") == "stopped",
            10,
            "the page to stop",
        )
        # the server aborted the generation: nothing runs and every block is free again
        wait_for(
            lambda: (
                (s := state())["num_running"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]
            ),
            10,
            "the KV blocks to be freed",
        )
    assert browser.find_element(By.ID, "send").is_enabled()
