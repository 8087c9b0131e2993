"""A real Prometheus server for tests, on a free loopback port.

Starts the ``prometheus`` binary (Debian's package in CI) with a temporary
config that scrapes one target every second, and answers PromQL through the
HTTP API with the standard library only::

    with PrometheusServer(tmp_path, f"127.0.0.1:{srv.metrics_port}") as prom:
        prom.wait_for(lambda: prom.query('up{job="layertap"} == 1'))
        rows = prom.query("layertap_activation_drift > layertap_activation_drift_threshold")

Only a missing binary skips the test; any other failure to start fails it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
JOB = "layertap"

T = TypeVar("T")


def free_port() -> int:
    """A TCP port free on loopback right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prometheus_binary() -> str:
    """Path of ``prometheus``; skips the calling test when it is not installed."""
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus not on PATH (CI installs Debian's prometheus package)")
    return exe


class PromQLError(RuntimeError):
    """Prometheus answered a query with an error (bad PromQL, timeout...)."""


class PrometheusServer:
    """One ``prometheus`` process scraping ``target`` every second.

    Args:
        workdir: A fresh directory for the config, the TSDB and the log.
        target: ``host:port`` of the ``/metrics`` endpoint to scrape, or a list of them (one job).
        rule_files: Rule files to load (e.g. :data:`ALERTS`); evaluated every second.
        start_timeout: Seconds to wait for ``/-/ready``.
        scrape_extra: More YAML lines of the scrape job, indented 4 spaces
            (e.g. ``scheme: https`` and ``authorization:``).
    """

    def __init__(
        self,
        workdir: Path,
        target: str | Sequence[str],
        *,
        rule_files: Sequence[Path] = (),
        start_timeout: float = 60.0,
        scrape_extra: str = "",
    ) -> None:
        exe = prometheus_binary()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config = self.workdir / "prometheus.yml"
        rules = "".join(f"  - {json.dumps(str(p))}\n" for p in rule_files)
        self.config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  scrape_timeout: 1s\n"
            "  evaluation_interval: 1s\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + "scrape_configs:\n"
            f"  - job_name: {JOB}\n"
            + scrape_extra
            + "    static_configs:\n"
            f"      - targets: {json.dumps([target] if isinstance(target, str) else list(target))}\n",
            encoding="utf-8",
        )
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                exe,
                f"--config.file={self.config}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout:.0f}s:\n{self.log()}")

    def log(self) -> str:
        """The server's output so far (for assertion messages)."""
        self._log.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-4000:]

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>`` and return its ``data``.

        Raises:
            PromQLError: When Prometheus reports ``status: error``.
        """
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # 400/422 carry a JSON error body
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Evaluate an instant query now; the result rows (``metric``, ``value``).

        Scalars and strings come back as one row with an empty ``metric``.
        """
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def targets_up(self) -> bool:
        """True once the last scrape of the target succeeded."""
        return any(float(r["value"][1]) == 1.0 for r in self.query(f'up{{job="{JOB}"}}'))

    def wait_for(self, probe: Callable[[], T], timeout: float = 30.0, what: str = "") -> T:
        """Poll ``probe`` until it returns something truthy; fail with ``what`` on timeout."""
        end = time.monotonic() + timeout
        while True:
            got = probe()
            if got:
                return got
            if time.monotonic() >= end:
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what or probe}\n{self.log()}")
            time.sleep(0.25)

    def stop(self) -> None:
        """Terminate the process (SIGTERM, then SIGKILL) and close the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sample_value(row: dict[str, Any]) -> float:
    """The float of an instant-vector row (``"NaN"``, ``"+Inf"`` parse too)."""
    return float(row["value"][1])
