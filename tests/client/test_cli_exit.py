"""The console script's exit: it asks the server whether a compile still runs only when a server ran.

``layertap demo drift --target`` loads ``layertap.server.cli`` but no server; on a
thin install (no torch) its exit must not import one (issue 41's review).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

_RUN = """
import sys
sys.modules["torch"] = None  # a thin install: any import of torch fails
sys.argv = ["layertap", "demo", "drift", "--target", "127.0.0.1:{port}"]
from layertap.cli import run
run()
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_a_demo_against_an_unreachable_target_exits_with_its_error_and_imports_no_server() -> None:
    res = subprocess.run([sys.executable, "-c", _RUN.format(port=_closed_port())], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert "layertap" in res.stderr and "127.0.0.1" in res.stderr, res.stderr


def test_settled_is_true_when_no_server_ran_in_this_process() -> None:
    res = subprocess.run([sys.executable, "-c", "import sys; from layertap.server.cli import settled; "
                          "print(settled(0.0), 'layertap.server.app' in sys.modules, 'torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert res.stdout.split() == ["True", "False", "False"], res.stdout + res.stderr
