"""The studio page in a real headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium): bars where the layout puts them, a bad schema's line, a prompt sent and its spans
coloured, the cache view moving with traffic, and one namespace's key never showing another's
entries. The JSON routes underneath are tested in test_studio.py."""

from __future__ import annotations

import shutil
import tempfile

import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium (dev extra)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from programs import needs  # noqa: E402
from promptcache.layout import layout_schema  # noqa: E402
from promptcache.pml import PMLError  # noqa: E402
from serverkit import MODEL, ROOT, client  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000")
TOKYO = '<prompt schema="travel"><user><trip days="four" travelers="two"/><tokyo/> What to eat?</user></prompt>'


pytestmark = needs("chromium", "chromedriver")


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="studio-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS + (f"--user-data-dir={profile}",):
        opts.add_argument(f)
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_script_timeout(60)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait(driver, cond, timeout=60):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: cond(d))


def open_page(driver, url: str, key: str | None = None, view: str = "schema", ready: bool = True):
    driver.get(f"{url}/studio#{view}")
    driver.execute_script("sessionStorage.clear()")
    if key is not None:
        driver.execute_script("sessionStorage.setItem('promptcache-key', arguments[0])", key)
    driver.refresh()
    if ready:
        wait(driver, lambda d: d.execute_script("return document.body.dataset.ready") == "true")


def test_schema_bars_at_their_positions(browser, server, pc):
    open_page(browser, server[0])
    layout = pc.schema("travel").layout
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#schema-axis .bar.module"))
    axis = browser.find_element(By.ID, "schema-axis").rect
    for path, m in layout.modules.items():
        bar = browser.find_element(By.CSS_SELECTOR, f'#schema-axis .bar.module[data-name="{"/".join(path)}"]')
        r = bar.rect
        assert abs(r["x"] - axis["x"] - axis["width"] * m.start / layout.end) <= 2, path
        assert abs(r["width"] + 1 - axis["width"] * (m.end - m.start) / layout.end) <= 2, path
    members = [browser.find_element(By.CSS_SELECTOR, f'.bar.module[data-name="{n}"]').rect
               for n in ("paris", "tokyo", "rome")]
    assert len({round(r["x"]) for r in members}) == 1 and len({r["y"] for r in members}) == 3  # stacked
    days = browser.find_element(By.CSS_SELECTOR, '#schema-axis .bar[data-name="trip.days"]')
    assert "len 4" in days.text
    tokyo_text = browser.find_element(By.CSS_SELECTOR, '#schema-axis .bar.span[data-name="tokyo"]')
    webdriver.ActionChains(browser).move_to_element(tokyo_text).perform()
    tip = browser.find_element(By.ID, "tip")
    wait(browser, lambda d: tip.is_displayed() and "Tokyo" in tip.text)  # hover shows the tokens


@pytest.mark.parametrize("old, new", [('<module name="rome">', '<module name="rome" colour="red">'),
                                      ('<module name="rome">', '<modul name="rome">')])
def test_invalid_schema_shows_its_line(browser, server, pc, old, new):
    open_page(browser, server[0])
    bad = (ROOT / "schemas" / "travel.xml").read_text().replace(old, new)
    with pytest.raises(PMLError) as e:  # what `promptcache validate` reports
        layout_schema(bad, pc.tok)
    line = e.value.line
    assert line is not None
    box = browser.find_element(By.ID, "schema-text")
    browser.execute_script("arguments[0].value = arguments[1]", box, bad)
    browser.find_element(By.ID, "schema-show").click()
    err = browser.find_element(By.ID, "schema-error")
    wait(browser, lambda d: err.is_displayed())
    assert err.get_attribute("data-line") == str(line) and err.text.startswith(f"line {line}:")
    assert not browser.find_elements(By.CSS_SELECTOR, "#schema-axis .bar")


def test_every_error_of_a_schema_is_shown(browser, server, pc):
    open_page(browser, server[0])
    bad = (ROOT / "schemas" / "travel.xml").read_text().replace(
        '<module name="rome">', '<module name="rome" colour="red">').replace('<module name="kyoto">',
                                                                           '<module name="kyoto" cache="maybe">')
    with pytest.raises(PMLError) as e:  # what `promptcache validate` reports, one line each
        layout_schema(bad, pc.tok)
    want = [f"line {x.line}: {x.reason}" for x in e.value.errors]
    assert len(want) == 2
    browser.execute_script("arguments[0].value = arguments[1]", browser.find_element(By.ID, "schema-text"), bad)
    browser.find_element(By.ID, "schema-show").click()
    err = browser.find_element(By.ID, "schema-error")
    wait(browser, lambda d: err.is_displayed())
    assert err.text.splitlines() == want and err.get_attribute("data-line") == str(e.value.errors[0].line)


def test_send_a_prompt_spans_coloured_and_answer(browser, server):
    open_page(browser, server[0], view="prompt")
    browser.execute_script("arguments[0].value = arguments[1]", browser.find_element(By.ID, "prompt-text"), TOKYO)
    browser.find_element(By.ID, "prompt-full").click()
    browser.find_element(By.ID, "prompt-send").click()
    wait(browser, lambda d: d.find_element(By.ID, "full-answer").get_attribute("data-done") == "true")
    spans = {b.get_attribute("data-name"): b for b in browser.find_elements(By.CSS_SELECTOR, "#prompt-axis .bar.span")}
    assert spans["(schema)"].get_attribute("data-origin") in ("pool", "host", "device")  # cached
    assert spans["trip.days"].get_attribute("data-origin") == "computed"
    assert spans["tokyo"].get_attribute("data-origin") == "drifted"
    colours = {spans[n].value_of_css_property("background-color") for n in ("(schema)", "trip.days", "tokyo")}
    assert len(colours) == 3
    assert browser.find_elements(By.CSS_SELECTOR, "#prompt-axis .bar.gap")
    assert "approximate" in browser.find_element(By.ID, "prompt-summary").text
    answer, stats = browser.find_element(By.ID, "answer"), browser.find_element(By.ID, "answer-stats")
    assert answer.text and "TTFT" in stats.text and "recomputed" in stats.text
    assert int(stats.get_attribute("data-cached")) > 0
    assert browser.find_element(By.ID, "full-answer").text and "0 cached" in browser.find_element(By.ID, "full-stats").text


def test_cache_view_changes_after_requests(browser, server):
    open_page(browser, server[0], view="cache")
    head = browser.find_element(By.ID, "cache-namespace")
    wait(browser, lambda d: "requests" in head.text)
    before = head.text
    msgs = [{"role": "user", "content": "A question for the cache view of the studio page. " * 3}]
    for _ in range(2):
        client(server[0]).chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    count = lambda text: int(text.split(" · ")[1].split()[0])  # noqa: E731 - "namespace 'x' · N requests · ..."
    wait(browser, lambda d: count(head.text) >= count(before) + 2, timeout=10)  # polled once a second
    assert browser.find_elements(By.CSS_SELECTOR, "#cache-blocks i.yours")
    # the series is 10-second buckets over the last 600 s: on a slow run the module's first requests
    # age out, so the count of points may shrink; what holds is that these requests drew a point
    assert int(browser.find_element(By.ID, "hit-chart").get_attribute("data-points")) >= 1
    # read in one script: the page rebuilds the table every second, so rows found one call earlier go stale
    rows = browser.execute_script("return [...document.querySelectorAll('#cache-entries tbody tr')]"
                                  ".map((r) => r.innerText)")
    assert any("A question for the cache" in r for r in rows)

YOURS = ("return [...document.querySelectorAll('#cache-blocks i')]"
         ".map((b, i) => b.classList.contains('yours') ? i : -1).filter((i) => i >= 0)")


def test_a_key_never_sees_another_namespace(browser, tenants):
    secret = "Globex secret launch codes are in the third drawer. " * 3
    client(tenants, "key-g").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": secret}],
                                                     max_tokens=2)
    open_page(browser, tenants, view="cache", ready=False)  # no key: the page asks for one
    form = browser.find_element(By.ID, "key-form")
    wait(browser, lambda d: form.is_displayed())
    browser.find_element(By.ID, "key").send_keys("key-g")
    form.submit()
    head = browser.find_element(By.ID, "cache-namespace")
    wait(browser, lambda d: "globex" in head.text and d.find_elements(By.CSS_SELECTOR, "#cache-entries tbody tr.pool"))
    assert "Globex secret" in browser.find_element(By.ID, "cache-entries").text
    mine_g = set(browser.execute_script(YOURS))
    assert mine_g
    open_page(browser, tenants, key="key-a", view="cache")
    wait(browser, lambda d: "acme" in d.find_element(By.ID, "cache-namespace").text
         and d.find_elements(By.CSS_SELECTOR, "#cache-blocks i"))
    assert "Globex" not in browser.page_source
    assert not mine_g & set(browser.execute_script(YOURS))  # globex's blocks are not marked as acme's
    assert browser.find_elements(By.CSS_SELECTOR, "#cache-blocks i.b-idle, #cache-blocks i.b-shared")
