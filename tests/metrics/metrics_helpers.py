"""What the metrics tests share: a text-format file or page parsed with
prometheus_client's own parser, as samples by name and labels."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def samples(text: str) -> Samples:
    """{sample name: {sorted labels: value}} of a Prometheus text exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(got: Samples, name: str, **labels: str) -> float:
    """The value of the one sample `name` with exactly `labels`."""
    return got[name][tuple(sorted(labels.items()))]


def free_port() -> int:
    """A loopback port nobody listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> Samples:
    """GET http://127.0.0.1:PORT/metrics with a real HTTP client: its samples."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return samples(resp.read().decode())


def until(pred: Callable[[], Any], proc: subprocess.Popen[Any] | None, what: str,
          timeout: float = 30.0) -> Any:  # fmt: skip
    """Poll `pred` until it gives something true (`proc`, if any, still running)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None:
            assert proc.poll() is None, proc.communicate()
        try:
            got = pred()
        except (OSError, KeyError):  # not listening yet, a series not there yet
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
