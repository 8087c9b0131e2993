"""CLI argument parsing and error reporting, without a server."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from layertap import cli

pytestmark = pytest.mark.unit


def test_host_accepts_host_port_or_port() -> None:
    assert cli.parse_args(["layers", "50051"]).host == "127.0.0.1:50051"
    assert cli.parse_args(["layers", ":50051"]).host == "127.0.0.1:50051"
    assert cli.parse_args(["layers", "gpu-box:7000"]).host == "gpu-box:7000"


def test_capture_options() -> None:
    args = cli.parse_args(
        ["capture", "localhost:1", "layer4", "avgpool", "-o", "x.npz", "--input", "in.npy",
         "--n", "3", "--point", "input", "--max-batch", "2", "--dtype", "float16", "--timeout", "5"]
    )
    assert args.layers == ["layer4", "avgpool"]
    assert args.output == Path("x.npz") and args.input == Path("in.npy")
    assert (args.n, args.point, args.max_batch, args.dtype, args.timeout) == (3, "input", 2, "float16", 5.0)
    assert args.func is cli._cmd_capture


def test_capture_defaults() -> None:
    args = cli.parse_args(["capture", "1234", "layer4", "-o", "x.npy"])
    assert (args.n, args.point, args.max_batch, args.dtype, args.input) == (1, "output", None, None, None)


@pytest.mark.parametrize(
    "argv",
    [
        ["capture", "1234", "layer4"],  # -o is required
        ["capture", "1234", "-o", "x.npy"],  # a layer is required
        ["capture", "1234", "layer4", "-o", "x.npy", "--n", "0"],
        ["capture", "1234", "layer4", "-o", "x.npy", "--dtype", "int8"],
        ["capture", "1234", "layer4", "-o", "x.npy", "--point", "grad_input"],
        ["watch", "1234", "layer*", "--reducers", ""],
        ["layers", "1234", "--timeout", "-1"],
        ["nope"],
        [],
    ],
)
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2


def test_watch_options() -> None:
    args = cli.parse_args(["watch", "1234", "layer*", "--reducers", "moments, nonfinite", "--every", "10"])
    assert args.selector == "layer*" and args.reducers == ["moments", "nonfinite"] and args.every == 10
    default = cli.parse_args(["watch", "1234", "re:layer[12]"])
    assert default.reducers == ["moments", "minmax", "nonfinite"] and default.every is None
    assert not default.keep_padding and cli.parse_args(["watch", "1234", "x", "--keep-padding"]).keep_padding


def test_baseline_drift_taps_stats() -> None:
    args = cli.parse_args(["baseline", "1234", "layer*", "--passes", "20", "--psi", "0.25"])
    assert (args.passes, args.window, args.psi, args.js) == (20, 50, 0.25, None)
    assert cli.parse_args(["drift", "1234"]).selector == ""
    assert cli.parse_args(["drift", "1234", "layer3"]).selector == "layer3"
    assert cli.parse_args(["taps", "1234"]).func is cli._cmd_taps
    assert cli.parse_args(["stats", "1234"]).func is cli._cmd_stats


def test_serve_and_demo_pass_arguments_through() -> None:
    args = cli.parse_args(["serve", "--port", "0", "--model", "resnet50", "--help"])
    assert args.command == "serve" and args.rest == ["--port", "0", "--model", "resnet50", "--help"]
    demo = cli.parse_args(["demo", "drift", "--host", "x:1"])
    assert (demo.command, demo.demo, demo.rest) == ("demo", "drift", ["--host", "x:1"])


def test_unknown_demo_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "nope"]) == 2
    assert "drift" in capsys.readouterr().err


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    out = capsys.readouterr().out
    for command in ("layers", "capture", "watch", "baseline", "drift", "taps", "serve", "demo"):
        assert command in out


def test_sparkline() -> None:
    assert cli.sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert cli.sparkline([1.0, 1.0]) == "▄▄"
    assert cli.sparkline([0.0, float("nan"), 1.0]) == "▁ █"
    assert len(cli.sparkline(range(100))) == cli.SPARK_WIDTH
    assert cli.sparkline([]) == ""


def test_unreachable_server_prints_one_line_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["layers", str(port), "--timeout", "3"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layertap: error:")
    assert "UNAVAILABLE" in lines[0] and "Traceback" not in captured.err


def test_missing_input_file_is_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = cli.main(["capture", "1", "layer4", "-o", str(tmp_path / "x.npy"), "--input", str(tmp_path / "nope.npy")])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.npy" in err[0]


@pytest.mark.parametrize(
    "argv",
    [["layers", "1234"], ["watch", "1234", "layer*"], ["taps", "1234"], ["stats", "1234"], ["drift", "1234"]],
)
def test_read_commands_take_json(argv: list[str]) -> None:
    assert cli.parse_args(argv).json is False
    assert cli.parse_args([*argv, "--json"]).json is True
