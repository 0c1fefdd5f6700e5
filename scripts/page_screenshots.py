#!/usr/bin/env python
"""Screenshots of the /dashboard and /chat pages for the docs (headless Chromium).

Starts one deployment per policy (vllm, then sarathi) serving the HTTP API, replays the
same workload (Poisson arrivals, prompts of mixed length, some long) through it, and
photographs the dashboard near the end of each run: with vllm the long prompts run as
prefill-only iterations while the decodes wait (the iteration-time spikes), with sarathi
every iteration carries the decodes beside a prompt chunk under the budget. Then a chat
turn on the last deployment. Writes PNGs into --out (default docs/img).

    python scripts/page_screenshots.py [--out docs/img] [--requests 24]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import threading
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from sarazmq.config import CacheConfig, DeploymentConfig, EngineConfig, SchedulerConfig
from sarazmq.procs.endpoints import free_tcp_port
from sarazmq.procs.launcher import Deployment
from sarazmq.replay.openai_driver import replay_openai
from sarazmq.replay.workload import WorkloadSpec, build_workload

MODEL = "smollm2-135m-instruct"
KEY = "screenshot-key"


def browser() -> webdriver.Chrome:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        sys.exit("error: needs Debian's chromium and chromium-driver (apt-get install ...)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1150"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


def with_key(b: webdriver.Chrome, url: str) -> None:
    b.get(url)
    b.execute_script("sessionStorage.setItem('sarazmq-api-key', arguments[0])", KEY)
    b.get(url)


def replay_through(root: str, requests: list) -> None:
    asyncio.run(replay_openai(f"{root}/v1", MODEL, requests, api_key=KEY, progress=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--requests", type=int, default=24)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec(
        vocab_size=49152,
        avoid_ids=(0, 1, 2),
        lengths="uniform",
        input_range=(32, 900),
        output_range=(24, 64),
        arrivals="poisson",
        qps=1.5,
        max_requests=args.requests,
        seed=7,
    )
    requests = build_workload(spec)
    b = browser()
    try:
        for policy in ("vllm", "sarathi"):
            config = EngineConfig(
                dtype="float32",
                num_threads=1,
                scheduler=SchedulerConfig(policy=policy, chunk_size=128, max_model_len=2048),
                cache=CacheConfig(block_size=16, num_blocks=1024),
            )
            port = free_tcp_port()
            with Deployment(config, DeploymentConfig(http_port=port, api_key=KEY)):
                root = f"http://127.0.0.1:{port}"
                with_key(b, f"{root}/dashboard")
                run = threading.Thread(target=replay_through, args=(root, requests))
                run.start()
                # near the end of the arrivals: the chart then holds the busiest stretch
                time.sleep(requests[-1].arrival_s * 0.9)
                b.save_screenshot(str(out / f"dashboard_{policy}.png"))
                run.join()
                print(f"wrote {out}/dashboard_{policy}.png")
                if policy == "sarathi":
                    with_key(b, f"{root}/chat")
                    # greedy: the 135M default model wanders when sampled
                    for field, value in (("temperature", "0"), ("max-tokens", "64")):
                        b.find_element(By.ID, field).clear()
                        b.find_element(By.ID, field).send_keys(value)
                    box = b.find_element(By.ID, "prompt")
                    for text in ("What is the capital of France?", "And what is it famous for?"):
                        box.send_keys(text)
                        b.find_element(By.ID, "send").click()
                        deadline = time.monotonic() + 120
                        while time.monotonic() < deadline:
                            msgs = b.find_elements(By.CSS_SELECTOR, ".msg.assistant")
                            if msgs and msgs[-1].get_attribute("data-finish"):
                                break
                            time.sleep(0.2)
                    b.save_screenshot(str(out / "chat.png"))
                    print(f"wrote {out}/chat.png")
    finally:
        b.quit()


if __name__ == "__main__":
    main()
