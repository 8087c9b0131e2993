"""Captures take the tap selectors, and their bytes stay protobuf any client can read.

A real server, the real client and CLI, the demo model's own hooks as the
reference. The wire tests read the server's bytes raw and parse them with
the generated ``CaptureResponse.FromString``, as a client in another
language would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from support.e2e import batch, rich_details, wait_for
from support.models import layer_outputs

import layertap
from layertap import _capture
from layertap.v1 import telemetry_pb2, tensor_pb2

pytestmark = pytest.mark.e2e

BLOCKS = ["layer1", "layer2", "layer3", "layer4"]
CAPTURE = "/layertap.v1.TelemetryService/Capture"


def addr(srv) -> str:  # type: ignore[no-untyped-def]
    return f"127.0.0.1:{srv.port}"


def exact(got: np.ndarray, ref: np.ndarray) -> None:
    """The server computed in float32; the reference is those values widened to float64."""
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.astype(np.float64), ref)


# ------------------------------------------------------------------ selectors


def test_a_glob_returns_a_dict_keyed_by_layer_in_model_order(client):
    x = batch(2, seed=7)
    got = client.capture("layer*", input=x)
    assert list(got) == BLOCKS
    ref = layer_outputs(x, BLOCKS)
    for name in BLOCKS:
        exact(got[name], ref[name])


def test_a_regex_and_a_mixed_list_keep_request_order_without_repeats(client):
    x = batch(2, seed=8)
    names = ["layer1.0.conv1", "layer1.1.conv1", "layer2.0.conv1", "layer2.1.conv1"]
    got = client.capture(r"re:layer[12]\.\d\.conv1", input=x)
    assert list(got) == names
    ref = layer_outputs(x, [*names, "fc", "avgpool"])
    for name in names:
        exact(got[name], ref[name])
    mixed = client.capture(["fc", "layer?.1.conv1", "fc", "avgpool"], input=x)
    assert list(mixed) == ["fc", "layer1.1.conv1", "layer2.1.conv1", "layer3.1.conv1", "layer4.1.conv1", "avgpool"]
    exact(mixed["fc"], ref["fc"])
    exact(mixed["avgpool"], ref["avgpool"])


def test_exact_names_keep_their_shapes_and_the_old_request_field(client, demo_server):
    x = batch(2, seed=9)
    ref = layer_outputs(x, ["layer4", "fc"])
    one = client.capture("layer4", input=x)
    assert isinstance(one, np.ndarray)
    exact(one, ref["layer4"])
    both = client.capture(["fc", "layer4"], input=x)
    assert list(both) == ["fc", "layer4"]
    # Exact names travel in `layers`, which servers without `selectors` understand.
    req = _capture.capture_request(["fc", "layer4"], input=None, passes=1, point="output",
                                            max_batch=None, dtype=None)
    assert list(req.layers) == ["fc", "layer4"] and not req.selectors
    req = _capture.capture_request(["fc", "layer*"], input=None, passes=1, point="output",
                                            max_batch=None, dtype=None)
    assert list(req.selectors) == ["fc", "layer*"] and not req.layers


def test_passive_glob_capture_of_two_passes(client, demo_server):
    xs = [batch(2, seed=s) for s in (31, 32)]
    out: list = []
    t = threading.Thread(target=lambda: out.append(client.capture("layer[34]", n=2, timeout=30)))
    t.start()
    assert wait_for(lambda: demo_server.state.host.hooks.active == 2)
    with layertap.Client(addr(demo_server)) as other:
        for x in xs:
            other.infer(x)
    t.join(30)
    assert isinstance(out[0], list) and len(out[0]) == 2
    for got, x in zip(out[0], xs):
        ref = layer_outputs(x, ["layer3", "layer4"])
        assert list(got) == ["layer3", "layer4"]
        exact(got["layer3"], ref["layer3"])
        exact(got["layer4"], ref["layer4"])
    assert wait_for(lambda: demo_server.state.host.hooks.active == 0)


def test_a_selector_matching_nothing_is_not_found_naming_it(client):
    with pytest.raises(layertap.LayerNotFound) as info:
        client.capture(["fc", "head*"], input=batch(1))
    err = info.value
    assert (err.code, err.field, err.layer) == ("NOT_FOUND", "selectors[1]", "head*")
    assert "'head*' matches no layer" in err.details
    with pytest.raises(layertap.LayerNotFound) as info:
        client.capture("re:nothing.*", input=batch(1))
    assert info.value.field == "selectors[0]" and "'re:nothing.*'" in info.value.details
    assert client.stats().active_hooks == 0


@pytest.mark.parametrize("selector, why", [
    ("re:(a", "bad regex"),
    (r"re:(a)\1", "bad regex"),  # RE2 has no backreferences
    ("layer[1", "unclosed '['"),
    ("layer*" + "x" * 2000, "the limit is 1024"),
])
def test_a_malformed_selector_is_invalid_argument(client, selector, why):
    with pytest.raises(layertap.InvalidArgument, match=r"selectors\[0\]") as info:
        client.capture(selector, input=batch(1))
    assert info.value.field == "selectors[0]" and why in info.value.details
    _, violations = rich_details(info.value.__cause__)
    assert [f for f, _ in violations] == ["selectors[0]"]


def test_selectors_per_capture_are_capped(client):
    from layertap.server.taps.capture_options import MAX_CAPTURE_SELECTORS

    many = ["layer*"] * (MAX_CAPTURE_SELECTORS + 1)
    with pytest.raises(layertap.InvalidArgument, match=f"at most {MAX_CAPTURE_SELECTORS} selectors") as info:
        client.capture(many, input=batch(1))
    assert info.value.field == "selectors"
    assert list(client.capture(many[:MAX_CAPTURE_SELECTORS], input=batch(1))) == BLOCKS  # each layer once


def test_the_byte_cap_names_how_many_layers_matched(make_server):
    srv = make_server(max_capture_bytes=100_000)
    with layertap.Client(addr(srv)) as client:
        with pytest.raises(layertap.CaptureTooLarge) as info:
            client.capture("**", input=batch(4))
        matched = len(srv.state.host.layer_names)
        assert f"({matched} layers matched the request)" in info.value.details
        assert info.value.metadata["layers_matched"] == str(matched)
        assert info.value.metadata["max_bytes"] == "100000"
        with pytest.raises(layertap.CaptureTooLarge, match=r"\(1 layer matched the request\)"):
            client.capture("layer1", input=batch(8))  # 131,072 bytes
        assert client.stats().active_hooks == 0
        assert list(client.capture("layer4.?.conv1", input=batch(1))) == ["layer4.0.conv1", "layer4.1.conv1"]


def test_a_glob_needs_one_of_its_layers_to_run_a_name_each(make_server):
    import torch

    from layertap.server.host.sources import InputSpec, LoadedModel

    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_a = torch.nn.Linear(4, 2)
            self.head_b = torch.nn.Linear(4, 2)  # never called
            self.tail_b = torch.nn.Linear(4, 2)  # never called

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head_a(x)

    srv = make_server(LoadedModel(TwoHeads(), "heads", "factory", [InputSpec("x", torch.float32, (-1, 4))]))
    x = np.ones((3, 4), np.float32)
    with layertap.Client(addr(srv)) as client:
        got = client.capture("head_*", input=x)
        assert list(got) == ["head_a"] and got["head_a"].shape == (3, 2)
        with pytest.raises(layertap.FailedPrecondition, match=r"none of the 1 layer\(s\) selector 'tail_\*'") as info:
            client.capture(["head_*", "tail_*"], input=x)
        assert info.value.field == "selectors[1]"
        with pytest.raises(layertap.FailedPrecondition, match="'head_b' did not run") as info:
            client.capture(["head_a", "head_b"], input=x)
        assert info.value.field == "layers[1]"
        assert client.stats().active_hooks == 0


def test_cli_capture_takes_a_glob(demo_server, tmp_path):
    x = batch(2, seed=4)
    inp, out = tmp_path / "in.npy", tmp_path / "blocks.npz"
    np.save(inp, x)
    run = subprocess.run([sys.executable, "-m", "layertap.cli", "capture", addr(demo_server), "layer*",
                          "--input", str(inp), "-o", str(out)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    arrays = np.load(out)
    assert arrays.files == BLOCKS
    ref = layer_outputs(x, BLOCKS)
    for name in BLOCKS:
        exact(arrays[name], ref[name])
    miss = subprocess.run([sys.executable, "-m", "layertap.cli", "capture", addr(demo_server), "head*",
                           "--input", str(inp), "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert miss.returncode == 1 and "'head*' matches no layer" in miss.stderr and "Traceback" not in miss.stderr


# ------------------------------------------------------------------ the wire: protobuf for every client


def _raw_capture(target: str, req: telemetry_pb2.CaptureRequest, **kw) -> list[bytes]:  # type: ignore[no-untyped-def]
    """The server's response messages as bytes, untouched (no deserializer)."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream(CAPTURE, request_serializer=telemetry_pb2.CaptureRequest.SerializeToString)
        return list(call(req, timeout=60, **kw))


def test_the_servers_bytes_parse_with_the_generated_protobuf(make_server):
    import torch
    from support.models import identity

    from layertap.server.host.sources import InputSpec, LoadedModel

    srv = make_server(LoadedModel(identity(), "identity", "factory", [InputSpec("x", torch.float32, (-1, 1024))]))
    x = np.random.default_rng(5).standard_normal((1100, 1024)).astype(np.float32)  # 4.3 MiB: 5 chunks
    req = telemetry_pb2.CaptureRequest(layers=["body"], inputs=[tensor_pb2.Tensor(
        dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=list(x.shape), raw_data=x.tobytes())])
    raw = _raw_capture(addr(srv), req)
    msgs = [telemetry_pb2.CaptureResponse.FromString(m) for m in raw]
    # Canonical protobuf: re-serializing the parsed message gives the same bytes back.
    assert [m.SerializeToString() for m in msgs] == raw
    header, chunks = msgs[0].header, [m.chunk for m in msgs[1:]]
    assert msgs[0].WhichOneof("payload") == "header" and all(m.WhichOneof("payload") == "chunk" for m in msgs[1:])
    assert (header.layer, list(header.shape), header.total_bytes, header.num_chunks) == (
        "body", [1100, 1024], x.nbytes, 5)
    assert [c.chunk_index for c in chunks] == list(range(5))
    assert [c.offset for c in chunks] == [i << 20 for i in range(5)]
    assert {c.tensor_id for c in chunks} == {header.tensor_id}
    np.testing.assert_array_equal(np.frombuffer(b"".join(c.data for c in chunks), np.float32).reshape(x.shape), x)
    # The real client, reading chunks in place, gets the same tensor.
    with layertap.Client(addr(srv), max_message_bytes=64 << 20) as client:
        np.testing.assert_array_equal(client.capture("body", input=x), x)


def test_interceptors_still_guard_the_capture_handler(make_server, tmp_path):
    from layertap.server.rpc.auth import new_token

    reader, reader_line = new_token("reader", ["read"])
    taker, taker_line = new_token("taker", ["infer", "read", "capture"])
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{reader_line}\n{taker_line}\n")
    # A principal may use every worker here: the stream slot, not the principal share, is under test.
    srv = make_server(auth_tokens=str(tokens), max_streams=1, workers=4, principal_share=1.0)
    x = batch(1)
    with layertap.Client(addr(srv), token=reader) as client, pytest.raises(layertap.LayertapError) as info:
        client.capture("fc", input=x)
    assert info.value.code == "PERMISSION_DENIED" and info.value.metadata["scope"] == "capture"
    with layertap.Client(addr(srv), token=taker) as client:
        exact(client.capture("fc", input=x), layer_outputs(x, ["fc"])["fc"])
        # One stream slot: a passive capture holds it, a second capture is refused by admission.
        out: list = []
        t = threading.Thread(target=lambda: out.append(client.capture("fc", timeout=30)))
        t.start()
        assert wait_for(lambda: srv.state.host.hooks.active == 1)
        with pytest.raises(layertap.ResourceExhausted) as full:
            client.capture("fc", input=x)
        assert full.value.metadata["max_streams"] == "1"
        client.infer(x)
        t.join(30)
        exact(out[0], layer_outputs(x, ["fc"])["fc"])
