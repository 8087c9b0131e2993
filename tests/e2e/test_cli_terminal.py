"""The CLI as a terminal and as a pipe see it, against a real ``layertap serve``.

The model is a small transformer whose module names are long and dotted
(``encoder.layers.0.self_attn.out_proj``): users copy them out of these tables
into selectors, so no output may cut them. Terminal runs go through a
pseudo-terminal of 80 columns; pipe runs read the child's stdout as a script
would. JSON lines are parsed with ``json.loads`` and compared with what the
real client returns.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import re
import select
import shlex
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from support.e2e import wait_for
from support.encoder import TEXT_ENCODER_INPUT_SHAPE

import layertap

pytestmark = pytest.mark.e2e

COLUMNS = 80
ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-B])")
WATCH_SELECTOR = "encoder.layers.*.self_attn"


def cli_pipe(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The CLI with stdout a pipe, as in ``layertap ... | grep``."""
    return subprocess.run([sys.executable, "-m", "layertap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": str(COLUMNS)})


def cli_terminal(*args: str, timeout: float = 60) -> tuple[int, list[str]]:
    """The CLI on an 80x40 pseudo-terminal; returns its exit code and screen lines, escapes stripped."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
    env = {**os.environ, "COLUMNS": str(COLUMNS), "LINES": "40", "TERM": "xterm-256color"}
    for key in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "layertap.cli", *args], stdin=slave, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    end = time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                proc.kill()
                pytest.fail(f"`layertap {' '.join(args)}` did not finish in {timeout} s")
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout)
    finally:
        os.close(master)
    text = ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))
    return code, [line.rstrip("\r").rstrip() for line in re.split(r"\r?\n|\r", text)]


def body_rows(lines: list[str]) -> list[list[str]]:
    """The cells of a rich table's body rows (lines drawn with light verticals)."""
    return [[cell.strip() for cell in line.strip().strip("│").split("│")] for line in lines
            if line.startswith("│") and line.endswith("│")]


def plain(value: object) -> object:
    """A client dataclass as JSON would carry it: tuples as lists, datetimes as RFC 3339."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def assert_same_tree(got: object, want: object, path: str = "") -> None:
    """Equal structure, keys, ints and strings; floats to 1e-12 relative."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, got, want)
        for key in want:
            assert_same_tree(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (path, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-12), (path, got, want)
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


@pytest.fixture
def encoder_server(serve_process):
    return serve_process("--no-metrics", "--model", "support.encoder:text_encoder",
                         f"--input-shape={TEXT_ENCODER_INPUT_SHAPE}")


@pytest.fixture
def traffic(encoder_server) -> Iterator[np.ndarray]:
    """Live Infer calls with one fixed input, so every pass summarizes the same tensors."""
    x = np.random.default_rng(7).standard_normal((2, 8, 32)).astype(np.float32)
    stop = threading.Event()

    def run() -> None:
        with layertap.Client(encoder_server.address) as client:
            while not stop.is_set():
                client.infer(x)
                time.sleep(0.01)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    yield x
    stop.set()
    t.join(30)


@pytest.mark.parametrize("stdout", ["terminal", "pipe"])
def test_layers_keeps_every_name_whole_and_each_row_on_one_line(encoder_server, stdout):
    with layertap.Client(encoder_server.address) as client:
        layers = client.layers()
    names = [layer.name for layer in layers]
    assert "encoder.layers.0.self_attn.out_proj" in names
    if stdout == "terminal":
        code, lines = cli_terminal("layers", encoder_server.address)
    else:
        out = cli_pipe("layers", encoder_server.address)
        code, lines = out.returncode, out.stdout.splitlines()
    assert code == 0, lines
    assert max(len(line) for line in lines) <= COLUMNS, lines
    rows = body_rows(lines)
    # One row per layer, one line per row, and the first cell is the whole name.
    assert [row[0] for row in rows] == names, lines
    # Other columns gave way, narrowest first: the output shapes are still there, whole.
    shapes = {row[0]: row[-1] for row in rows}
    assert re.fullmatch(r"\([12], 8, 32\)", shapes["encoder.layers.1.self_attn"]), rows


def test_layers_json_is_what_the_client_returns(encoder_server):
    out = cli_pipe("layers", encoder_server.address, "--json")
    assert out.returncode == 0, out.stderr
    with layertap.Client(encoder_server.address) as client:
        layers = client.layers()
    assert [json.loads(line) for line in out.stdout.splitlines()] == [plain(layer) for layer in layers]


def test_serve_suggests_a_layer_the_model_has_and_the_suggestion_works(encoder_server, tmp_path):
    (hint,) = [line for line in encoder_server.lines if line.startswith("layertap: try")]
    command = shlex.split(hint.split("`")[1])
    assert command[:3] == ["layertap", "capture", encoder_server.address]
    layer = command[3]
    assert layer == "encoder.layers.1"  # the last block, not the demo's layer4
    # Run the hint as printed, with no traffic: an active capture of a random input that fits the metadata.
    assert "--random-input" in command
    out_file = tmp_path / command[command.index("-o") + 1]
    done = subprocess.run([sys.executable, "-m", "layertap.cli", *command[1:]], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    captured = np.load(out_file)
    assert captured.shape == (1, 8, 32) and np.isfinite(captured).all()  # batch 1 for the free dim


def test_watch_in_a_pipe_prints_each_summary_as_it_arrives(encoder_server, traffic):
    proc = subprocess.Popen([sys.executable, "-m", "layertap.cli", "watch", encoder_server.address, WATCH_SELECTOR],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no line within 60 s while watch kept running"
        first = proc.stdout.readline()
        assert proc.poll() is None, "the first line came only when watch exited"
        assert re.match(r"encoder\.layers\.[01]\.self_attn pass=\d+ ", first), first
    finally:
        proc.terminate()
        proc.wait(30)


def test_watch_count_in_a_pipe_prints_exactly_count_lines_with_the_clients_numbers(encoder_server, traffic):
    out = cli_pipe("watch", encoder_server.address, WATCH_SELECTOR, "--count", "6")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 6, lines
    with layertap.Client(encoder_server.address) as client, client.watch(WATCH_SELECTOR) as stream:
        ref: dict[str, layertap.Summary] = {}
        for s in stream:
            ref[s.layer] = s
            if len(ref) == 2:
                break
    for line in lines:
        name, *pairs = line.split()
        values = dict(pair.split("=") for pair in pairs if "=" in pair)
        s = ref[name]
        expected = {"mean": s.results["moments"].mean, "std": s.results["moments"].std,
                    "min": s.results["minmax"].min, "max": s.results["minmax"].max}
        for key, value in expected.items():
            assert math.isclose(float(values[key]), value, rel_tol=5e-4, abs_tol=1e-12), (line, key, value)
        assert values["nan"] == "0" and values["inf"] == "0"


def test_watch_json_lines_are_the_clients_summaries(encoder_server, traffic):
    out = cli_pipe("watch", encoder_server.address, WATCH_SELECTOR, "--count", "4", "--json",
                   "--reducers", "moments,minmax,nonfinite,norm")
    assert out.returncode == 0, out.stderr
    got = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(got) == 4
    with layertap.Client(encoder_server.address) as client, client.watch(
        WATCH_SELECTOR, reducers=["moments", "minmax", "nonfinite", "norm"]
    ) as stream:
        ref: dict[str, dict] = {}
        for s in stream:
            ref[s.layer] = plain(s)
            if len(ref) == 2:
                break
    per_pass = ("tap", "pass_index", "wall_time")
    for summary in got:
        want = ref[summary["layer"]]
        # The same input on every pass: the same numbers (up to the float64
        # summation order of two taps). Only the tap id, the pass and its time differ.
        assert_same_tree({k: v for k, v in summary.items() if k not in per_pass},
                         {k: v for k, v in want.items() if k not in per_pass})
        assert summary["results"]["norm"]["l2"] > 0


def test_watch_on_a_terminal_draws_a_table_with_whole_names(encoder_server, traffic):
    code, lines = cli_terminal("watch", encoder_server.address, WATCH_SELECTOR, "--count", "8")
    assert code == 0, lines
    assert max(len(line) for line in lines) <= COLUMNS, lines
    names = {row[0] for row in body_rows(lines)}
    assert names == {"encoder.layers.0.self_attn", "encoder.layers.1.self_attn"}, lines


def test_taps_stats_drift_json_are_what_the_client_returns(encoder_server, traffic, tmp_path):
    with layertap.Client(encoder_server.address) as client:
        client.set_baseline("encoder.layers.*", passes=3, window=3)
        assert wait_for(lambda: all(d.state == "ready" for d in client.drift()), 60)
        with client.tap(WATCH_SELECTOR, name="a-tap", ttl=600):
            for command, read in (("taps", client.taps), ("drift", client.drift)):
                out = cli_pipe(command, encoder_server.address, "--json")
                assert out.returncode == 0, out.stderr
                got = [json.loads(line) for line in out.stdout.splitlines()]
                want = [plain(item) for item in read()]
                # Counters move with the live traffic between the two reads: compare the rest.
                moving = {"hits", "drops", "window_passes", "psi", "js", "wasserstein", "mean_shift",
                          "drifted", "channel_drift_fraction", "score", "threshold", "p_value", "alarm",
                          "detection_passes", "alarm_pass", "scored_passes", "windows", "ignored_passes"}
                assert [{k: v for k, v in g.items() if k not in moving} for g in got] == \
                       [{k: v for k, v in w.items() if k not in moving} for w in want], command
                assert len(got) == 2 if command == "taps" else len(got) >= 2
        out = cli_pipe("stats", encoder_server.address, "--json")
        assert out.returncode == 0, out.stderr
        (stats,) = [json.loads(line) for line in out.stdout.splitlines()]
        want_stats = plain(client.stats())
        assert set(stats) == set(want_stats)
        for key in ("taps", "reducer_errors", "subscribers", "active_captures"):
            assert stats[key] == want_stats[key], key
        assert 0 < stats["passes"] <= want_stats["passes"]


def test_watch_piped_into_head_ends_quietly(encoder_server, traffic):
    watch = subprocess.Popen([sys.executable, "-m", "layertap.cli", "watch", encoder_server.address, WATCH_SELECTOR],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert watch.stdout is not None
    head = subprocess.run(["head", "-n", "2"], stdin=watch.stdout, capture_output=True, timeout=60)
    watch.stdout.close()
    assert len(head.stdout.decode().splitlines()) == 2
    assert watch.wait(30) == 0
    assert watch.stderr is not None and b"Traceback" not in watch.stderr.read()

