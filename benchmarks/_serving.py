"""What the transformer benchmarks share: a random-init Llama on disk, timing with CPU time,
``layertap serve`` as a subprocess, and a peer process driven round by round.

Imported by scripts run as ``python benchmarks/NAME.py`` (their folder is on
``sys.path``), also under another venv's interpreter (``--nnsight-python``),
so it needs only torch and transformers at import; layertap and the tests'
start-up reader are imported where a server starts.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

#: overhead.py's basic statistics: mean, std, min, max, zero fraction, NaN and Inf counts.
BASIC = ["moments", "minmax", "zero_fraction", "nonfinite"]
#: Every decoder layer of a Llama.
SELECTOR = "model.layers.*"
Cell = tuple[float, float]  # (median wall ms, CPU ms per call)


def save_llama(directory: str, config: Mapping[str, Any]) -> None:
    """Saves a random-init ``LlamaForCausalLM`` (seed 0) with ``save_pretrained``; nothing downloads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(directory)  # type: ignore[arg-type]


def load_model(directory: str, device: str | None = None) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    model: nn.Module = AutoModelForCausalLM.from_pretrained(directory)
    if device is not None:
        model = model.to(device)
    return model.eval()


def median_ms(call: Callable[[], object], n: int) -> float:
    return timed(call, n)[0]


def timed(call: Callable[[], object], n: int, cpu: Callable[[], float] = time.process_time) -> Cell:
    """(median wall ms, CPU ms per call of the process doing the work): the other engineers' load
    on the shared cores inflates wall time far more than the CPU time of the process measured."""
    times = []
    c0 = cpu()
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, (cpu() - c0) * 1e3 / n


def process_cpu(pid: int) -> Callable[[], float]:
    """Seconds of CPU another process has used (Linux /proc; user + system, all threads)."""
    tick = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick
    return read


def serve(args: Sequence[str], env: Mapping[str, str] | None = None, launch: Sequence[str] = ("-m", "layertap.cli"),
          stderr: IO[str] | None = None) -> tuple[subprocess.Popen[str], str, int | None]:
    """``layertap serve --port 0 ARGS`` as a subprocess: the process, its gRPC address and its metrics port
    (None with ``--no-metrics``), read from serve's start-up lines.

    A subprocess, so that the benchmark's client and the server do not share a GIL. ``launch`` replaces
    ``-m layertap.cli`` (a ``-c`` script that patches the server first, then runs ``layertap.cli.run``).
    The server's log goes to ``stderr`` (default: a temporary file, whose end a failed start quotes).
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # serve's start-up reader lives there
    from support.serve import read_startup

    log = stderr if stderr is not None else tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, *launch, "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            env=None if env is None else {**os.environ, **env})
    assert proc.stdout is not None
    port, metrics = read_startup(proc.stdout)
    if port < 0:
        code = proc.wait()
        log.seek(0)
        raise RuntimeError(f"layertap serve did not start (exit {code}): {log.read()[-2000:]}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, f"127.0.0.1:{port}", metrics


def start_server(directory: str, extra: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[str], str, int]:
    """``layertap serve --model hf:DIR`` on free ports (:func:`serve`): the process, its gRPC address and
    metrics port."""
    proc, address, metrics = serve(["--model", f"hf:{directory}", "--metrics-port", "0", *extra], env)
    if metrics is None:
        proc.kill()
        raise RuntimeError("layertap serve did not say its metrics port")
    return proc, address, metrics


def metric(metrics_port: int, name: str) -> float:
    """One sample of family ``name`` from the server's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        m = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def compiles(metrics_port: int) -> float:
    """The server's ``layertap_reducer_compiles_total``."""
    return metric(metrics_port, "layertap_reducer_compiles_total")


def settle_compiles(metrics_port: int, quiet: float = 5.0) -> float:
    """Waits until the reducers' background compiles stop (none new for ``quiet`` s); returns their count."""
    settled, last = time.monotonic(), compiles(metrics_port)
    while time.monotonic() - settled < quiet:
        time.sleep(1)
        if (now := compiles(metrics_port)) != last:
            settled, last = time.monotonic(), now
    return last


def answer_rounds(hello: Mapping[str, Any], one_round: Callable[[str], Mapping[str, Any]]) -> None:
    """The worker side of :class:`Peer`: ``hello``, then one JSON line per line read on stdin."""
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        print(json.dumps(one_round(line.strip())), flush=True)


class Peer:
    """A worker in another interpreter (``answer_rounds``), driven one round per :meth:`ask`."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self._proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=None if env is None else {**os.environ, **env})
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited ({self._proc.wait()})")
        return dict(json.loads(line))

    def ask(self, line: str) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{line}\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(30)
