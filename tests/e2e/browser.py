"""A real headless Chromium for page tests (Debian's chromium + chromedriver, via Selenium)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--window-size=1400,1000",
)


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """A browser session; fails (never skips) with the install command when one is missing."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver, (
        "the dashboard test needs a real browser: apt-get install chromium chromium-driver "
        "(./run test installs them when it may)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in FLAGS:
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service(driver))
    try:
        yield browser
    finally:
        browser.quit()
