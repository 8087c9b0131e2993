"""The first commands a newcomer runs: ``serve``'s start-up hint, ``infer``, ``serve --smoke``.

Each server is a real ``layertap serve`` subprocess with no traffic at all: the
hint must succeed on it as printed. The ``hf:`` model is a tiny random-init
GPT-2 saved with ``save_pretrained`` (nothing downloads); under ``CI=true`` a
missing transformers fails these tests instead of skipping them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from support.serve import read_startup

pytestmark = pytest.mark.e2e

HAVE_HF = importlib.util.find_spec("transformers") is not None or bool(os.environ.get("CI"))
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="transformers is not installed (pip install 'layertap[hf]')")
SERVE = [sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--no-metrics", "--device", "cpu",
         "--no-compile"]


def _cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "layertap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not HAVE_HF:
        pytest.skip("transformers is not installed")
    from support import hf_models

    path, _ = hf_models.save("gpt2", tmp_path_factory.mktemp("hf"))
    return path


@contextmanager
def _serve(model: str) -> Iterator[tuple[str, str]]:
    """A fresh ``layertap serve`` of ``model``: ``(address, the hint line)``; stopped afterwards."""
    proc = subprocess.Popen([*SERVE, "--model", model], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        port, _ = read_startup(proc.stdout, lines)
        assert port > 0 and lines and lines[-1].startswith("layertap: try"), (lines, proc.poll())
        yield f"127.0.0.1:{port}", lines[-1]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module", params=["demo", pytest.param("hf", marks=needs_hf)])
def fresh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """``(kind, address, hint)`` of a server that has run no Infer."""
    model = "demo" if request.param == "demo" else f"hf:{request.getfixturevalue('gpt2_dir')}"
    with _serve(model) as (address, hint):
        yield request.param, address, hint


def test_the_startup_hint_succeeds_on_a_fresh_server(fresh, tmp_path):
    kind, address, hint = fresh
    command = shlex.split(hint.split("`")[1])
    assert command[:3] == ["layertap", "capture", address] and "--random-input" in command
    if kind == "hf":
        assert command[command.index("--vocab-size") + 1] == "64"  # the tiny GPT-2's, below the default 100
    done = _cli(*command[1:], cwd=tmp_path)  # runs as printed: -o is relative, so it lands in tmp_path
    assert done.returncode == 0, done.stderr
    out = tmp_path / command[command.index("-o") + 1]
    array = np.load(out)
    assert array.size > 0 and np.isfinite(array).all()
    assert f"{command[3]}: float32 {tuple(array.shape)}" in done.stderr  # a tensor reported


def test_infer_sends_a_random_input_that_fits_the_metadata(fresh):
    kind, address, hint = fresh
    args = ["--vocab-size", "64"] if kind == "hf" else []
    done = _cli("infer", address, "--repeat", "2", *args)
    assert done.returncode == 0, done.stderr
    assert "random input: " in done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["call 1", "call 2"], lines
    assert ("logits float32 (1, 8, 64)" if kind == "hf" else "output float32 (1, 10)") in lines[0], lines


def test_infer_json_and_input_file(fresh, tmp_path):
    kind, address, _ = fresh
    if kind == "hf":
        x = {"input_ids": np.arange(6, dtype=np.int64).reshape(2, 3)}
        path = tmp_path / "in.npz"
        np.savez(path, **x)
        want = ("logits", [2, 3, 64])
    else:
        path = tmp_path / "in.npy"
        np.save(path, np.zeros((3, 3, 32, 32), np.float32))
        want = ("output", [3, 10])
    done = _cli("infer", address, "--input", str(path), "--json")
    assert done.returncode == 0, done.stderr
    (row,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert row["call"] == 1 and row["latency_ms"] > 0
    assert (row["outputs"][0]["name"], row["outputs"][0]["shape"]) == want, row


def test_a_passive_capture_that_times_out_names_cli_flags(fresh, tmp_path):
    _, address, hint = fresh
    layer = shlex.split(hint.split("`")[1])[3]
    done = _cli("capture", address, layer, "-o", str(tmp_path / "x.npy"), "--timeout", "1")
    assert done.returncode == 1
    assert "--random-input" in done.stderr and "--timeout" in done.stderr, done.stderr
    assert "input=" not in done.stderr and "timeout=" not in done.stderr, done.stderr


@pytest.mark.parametrize("kind", ["demo", pytest.param("hf", marks=needs_hf)])
def test_serve_smoke_passes(kind, request):
    model = "demo" if kind == "demo" else f"hf:{request.getfixturevalue('gpt2_dir')}"
    done = subprocess.run([*SERVE, "--smoke", "--model", model], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "layertap: captured " in done.stdout, done.stdout
    assert ("infer output (2, 2, 64)" if kind == "hf" else "infer output (2, 10)") in done.stdout, done.stdout


@needs_hf
def test_a_generative_model_prints_a_generate_command_that_succeeds(gpt2_dir, tmp_path):
    proc = subprocess.Popen([*SERVE, "--model", f"hf:{gpt2_dir}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        read_startup(proc.stdout, lines)
        line = proc.stdout.readline()
        assert line.startswith("layertap: generate with `"), (lines, line)
        command = shlex.split(line.split("`")[1])
        assert command[:2] == ["layertap", "generate"] and command[command.index("--watch") + 1] == "transformer.h.*"
        done = _cli(*command[1:], cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "8 tokens generated from 3 prompt tokens" in done.stdout, done.stdout
        assert done.stdout.count(" decode  transformer.h.0 ") == 7  # one line of layer means per decode pass
    finally:
        proc.terminate()
        proc.wait(30)
