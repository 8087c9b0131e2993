"""Shared fixtures: real servers on ephemeral loopback ports, real clients."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.serve import read_startup

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
sys.path.insert(0, str(TESTS_DIR))

#: The tiers: ``unit`` (in process, no server), ``e2e`` (real servers on loopback), ``slow`` (compiles,
#: drift calibration, DDP, Prometheus). Every test carries exactly one, set by its module's ``pytestmark``:
#: a module with any slow test is slow as a whole, so ``-m unit`` never runs one.
TIERS = ("unit", "e2e", "slow")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fails the run when a test carries no tier or more than one (before ``-m`` selects)."""
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {tiers or 'no tier'}")
    if wrong:
        raise pytest.UsageError("every test needs exactly one tier marker (unit, e2e or slow):\n  "
                                + "\n  ".join(wrong[:20]))


@pytest.fixture
def make_server():
    """Start in-process servers (port 0); all are stopped after the test."""
    from layertap.server.app import start_server
    from layertap.server.config import ServerConfig

    started = []

    def make(loaded=None, **overrides):
        # Compiling off: background compiles would steal CPU from timing-sensitive tests. The overhead
        # budget off: features' tests count every pass; the budget's own tests (test_overhead_budget) turn it on.
        cfg = ServerConfig(port=0, metrics_port=None, compile_reducers=False, tap_budget=0.0)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        srv = start_server(cfg, loaded)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.state.taps.close()
        srv.stop(0)


@pytest.fixture
def demo_server(make_server):
    return make_server()


@pytest.fixture
def client(demo_server):
    from layertap import Client

    with Client(f"127.0.0.1:{demo_server.port}") as c:
        yield c


class ServerProcess:
    """``layertap serve`` as a subprocess; the port is read from its stdout."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            # The overhead budget off unless a test names its own (the last --tap-budget wins), as make_server.
            [sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--no-compile", "--tap-budget", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
        )
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        self.port, self.metrics_port = read_startup(self.proc.stdout, self.lines)
        if self.port < 0:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"server did not start: {''.join(self.lines)}\n{err}")
        # Keep draining so the child never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        self.proc.stdout.read()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture
def serve_process() -> Iterator:
    procs: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        p = ServerProcess(*args, env=env)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()
