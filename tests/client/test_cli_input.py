"""Random inputs made from the metadata, and CLI error lines that name flags (no server needed)."""

from __future__ import annotations

import numpy as np
import pytest

from layertap._capture import no_traffic_hint
from layertap._errors import DeadlineExceeded
from layertap._types import TensorSpec
from layertap.cli.errors import cli_hint, error_line
from layertap.cli.input import random_inputs

pytestmark = pytest.mark.unit


def test_random_inputs_fit_every_required_input_and_leave_optional_ones_out():
    specs = [
        TensorSpec("input_ids", "int64", [-1, -1]),
        TensorSpec("attention_mask", "int64", [-1, -1], optional=True),
        TensorSpec("pixel_values", "bfloat16", [-1, 3, 4, 4]),
        TensorSpec("token_mask", "int32", [-1, -1]),
        TensorSpec("flags", "bool", [2]),
    ]
    got = random_inputs(specs, vocab_size=5, seed=0)
    assert list(got) == ["input_ids", "pixel_values", "token_mask", "flags"]
    assert got["input_ids"].dtype == np.int64 and got["input_ids"].shape == (1, 8)
    assert got["input_ids"].min() >= 0 and got["input_ids"].max() < 5
    assert got["pixel_values"].dtype == np.float32 and got["pixel_values"].shape == (1, 3, 4, 4)
    assert got["token_mask"].dtype == np.int32 and (got["token_mask"] == 1).all()
    assert got["flags"].dtype == np.bool_ and got["flags"].all()


def test_random_token_ids_default_below_100():
    ids = random_inputs([TensorSpec("x", "int64", [4, 256])], seed=1)["x"]
    assert ids.min() >= 0 and ids.max() < 100


def test_the_cli_names_flags_where_the_python_api_names_arguments():
    exc = DeadlineExceeded("Deadline Exceeded")
    exc.hint = no_traffic_hint(["layer4"], 1)
    # The Python API's message is unchanged.
    assert "pass input= for an active capture, or a longer timeout=" in str(exc)
    line = error_line(exc)
    assert "input=" not in line and "timeout=" not in line
    assert "pass --input FILE (or --random-input) for an active capture, or a longer --timeout SECONDS" in line
    assert line.startswith("Deadline Exceeded; ") and line.endswith("[DEADLINE_EXCEEDED]")


def test_cli_hint_leaves_the_rest_alone():
    assert cli_hint("max_batch=2 and the input= shape") == "max_batch=2 and the --input FILE (or --random-input) shape"
    assert error_line(ValueError("bad\n  value")) == "bad value"
