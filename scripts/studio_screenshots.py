"""Screenshots of the studio's three views for docs/studio.md (docs/studio_*.png).

    python scripts/studio_screenshots.py [--model smollm2] [--out docs]

Starts the server's app on the model with schemas/travel.xml, drives the page in headless
Chromium (/usr/bin/chromium + chromedriver, Selenium), sends a prompt with a full prefill beside
it, runs a little chat traffic for the cache view, and writes one PNG per view.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import threading
import time
from pathlib import Path

from PIL import Image
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from eval.serve_load import start_server
from promptcache.frontend.common import load_engine
from promptcache.server import create_app
from promptcache.server.core.compute import ComputeThread

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ('<prompt schema="travel"><user><trip days="four" travelers="two adults"/><tokyo/>'
          " Which district should we stay in?</user></prompt>")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1280,900")


def shot(driver, path: Path) -> None:
    """The page as a PNG, palette-reduced (a few hundred KB at most)."""
    img = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    img.quantize(colors=128).save(path, optimize=True)
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


def traffic(url: str, model: str, n: int) -> None:
    import openai

    oai = openai.OpenAI(base_url=url + "/v1", api_key="none")
    system = {"role": "system", "content": "You are a concise travel assistant. Answer in one sentence."}
    for i in range(n):
        city = ("Lisbon", "Kyoto", "Rome")[i % 3]
        oai.chat.completions.create(model=model, max_tokens=8,
                                    messages=[system, {"role": "user", "content": f"One tip for {city}?"}])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=str(ROOT / "docs"))
    args = ap.parse_args()
    out = Path(args.out)
    compute = ComputeThread()
    pc = compute.call(load_engine, args.model, None, "auto")
    compute.call(pc.add_schema, ROOT / "schemas" / "travel.xml")
    app = create_app(pc, model_name=args.model, compute=compute)
    app.state.studio_sources = {"travel": (ROOT / "schemas" / "travel.xml").read_text()}  # as `promptcache studio` does
    url = start_server(app)[1].removesuffix("/v1")
    profile = tempfile.mkdtemp(prefix="studio-shots-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for f in FLAGS + (f"--user-data-dir={profile}",):
        opts.add_argument(f)
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(shutil.which("chromedriver")))
    wait = lambda cond, t=300: WebDriverWait(driver, t, 0.2).until(lambda d: cond(d))  # noqa: E731
    try:
        driver.get(url + "/studio#schema")
        wait(lambda d: d.execute_script("return document.body.dataset.ready") == "true")
        span = driver.find_element(By.CSS_SELECTOR, '#schema-axis .bar.span[data-name="trip/season"]')
        webdriver.ActionChains(driver).move_to_element(span).perform()  # the hover lists the tokens
        time.sleep(0.5)
        shot(driver, out / "studio_schema.png")
        driver.find_element(By.CSS_SELECTOR, '.tab[data-view="prompt"]').click()
        driver.execute_script("arguments[0].value = arguments[1]", driver.find_element(By.ID, "prompt-text"), PROMPT)
        driver.find_element(By.ID, "prompt-full").click()
        driver.find_element(By.ID, "prompt-send").click()
        wait(lambda d: d.find_element(By.ID, "full-answer").get_attribute("data-done") == "true")
        time.sleep(1)
        shot(driver, out / "studio_prompt.png")
        traffic(url, args.model, 6)
        driver.set_window_size(1280, 1250)  # the cache view is long: pool, hit rates, entries, tiers
        driver.find_element(By.CSS_SELECTOR, '.tab[data-view="cache"]').click()
        thread = threading.Thread(target=traffic, args=(url, args.model, 3), daemon=True)
        thread.start()  # the view is live while traffic runs
        time.sleep(2.5)
        shot(driver, out / "studio_cache.png")
        thread.join()
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
