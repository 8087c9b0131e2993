"""Every request field is bounded: a clear INVALID_ARGUMENT naming the field, fast.

Each case is one that used to freeze the server, answer INTERNAL, or cost
seconds and hundreds of MB. Raw stubs are used so the exact request reaches
the server; the answers are read as any gRPC client reads them.
"""

from __future__ import annotations

import math
import time

import grpc
import numpy as np
import pytest
import torch
from support.e2e import batch, rich_details

import layertap
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.v1 import inference_pb2 as ipb
from layertap.v1 import inference_pb2_grpc, telemetry_pb2_grpc, tensor_pb2
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.e2e


@pytest.fixture
def stubs(demo_server):
    channel = grpc.insecure_channel(f"127.0.0.1:{demo_server.port}")
    yield demo_server, telemetry_pb2_grpc.TelemetryServiceStub(channel), inference_pb2_grpc.InferenceServiceStub(channel)
    channel.close()


def refused(call, request, code=grpc.StatusCode.INVALID_ARGUMENT, seconds: float = 5.0):
    """The RpcError of ``call(request)``: with ``code``, answered within ``seconds``."""
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=seconds + 5)
    assert time.monotonic() - start < seconds, "the answer was not prompt"
    assert info.value.code() == code, info.value.details()
    return info.value


def field_of(err) -> str:
    info, _ = rich_details(err)
    return info.metadata.get("field", "")


def moments() -> list[pb.ReducerSpec]:
    return [pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS)]


def healthy(srv) -> None:
    """The server still answers, and no hook was left behind by a refused call."""
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.infer(batch(1))
        assert client.stats(timeout=5).active_hooks == 0
        assert client.taps(timeout=5) == []


@pytest.mark.parametrize("selector", ["**" * 30 + "!", "re:(.*)*(.*)*(.*)*!"])
def test_catastrophic_selector_answers_not_found_and_the_server_lives(stubs, selector) -> None:
    srv, tel, _ = stubs
    err = refused(tel.CreateTap, pb.CreateTapRequest(spec=pb.TapSpec(selector=selector, reducers=moments())),
                  code=grpc.StatusCode.NOT_FOUND)
    assert field_of(err) == "spec.selector"
    refused(tel.GetDrift, pb.GetDriftRequest(selector=selector), code=grpc.StatusCode.NOT_FOUND)
    healthy(srv)


@pytest.mark.parametrize("selector", ["layer[z-a]", "re:(a|b", "re:(?P<x>a)(?P=x)", "x" * 2000])
def test_malformed_or_huge_selectors_are_invalid(stubs, selector) -> None:
    srv, tel, _ = stubs
    err = refused(tel.CreateTap, pb.CreateTapRequest(spec=pb.TapSpec(selector=selector, reducers=moments())))
    assert field_of(err) == "spec.selector"
    assert len(err.details()) < 500  # the input is not echoed whole
    stream = tel.Subscribe(pb.SubscribeRequest(stream_taps=[pb.TapSpec(selector=selector, reducers=moments())]),
                           timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(info.value) == "stream_taps[0].selector"
    healthy(srv)


@pytest.mark.parametrize("selector", ["re:a{99999999999}", "re:a{99999999999", "re:" + "(" * 500 + "a" + ")" * 500])
def test_extreme_regexes_never_answer_internal(stubs, selector) -> None:
    srv, tel, _ = stubs
    with pytest.raises(grpc.RpcError) as info:
        tel.CreateTap(pb.CreateTapRequest(spec=pb.TapSpec(selector=selector, reducers=moments())), timeout=10)
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), info.value.details()
    assert field_of(info.value) == "spec.selector"
    healthy(srv)


@pytest.mark.parametrize("name", ["n" * 257, "../../etc/passwd", "tap name", "", "-leading-dash", "tap\x00"])
def test_client_chosen_names_are_bounded_and_safe(stubs, name) -> None:
    srv, tel, _ = stubs
    if name:
        err = refused(tel.CreateTap, pb.CreateTapRequest(spec=pb.TapSpec(name=name, selector="layer1", reducers=moments())))
        assert field_of(err) == "spec.name"
        err = refused(tel.SetBaseline, pb.SetBaselineRequest(name=name, selector="layer1", passes=2))
        assert field_of(err) == "name"
    ok = pb.CreateTapRequest(spec=pb.TapSpec(name="a" * 256, selector="layer1", reducers=moments()))
    assert tel.CreateTap(ok, timeout=10).tap.id == "a" * 256
    tel.DeleteTap(pb.DeleteTapRequest(id="a" * 256), timeout=10)
    healthy(srv)


def test_unknown_layer_names_are_capped_before_lookup(stubs) -> None:
    srv, tel, _ = stubs
    err = refused(lambda r, timeout: next(tel.Capture(r, timeout=timeout)),
                  pb.CaptureRequest(layers=["layer4", "q" * 100_000]))
    assert field_of(err) == "layers[1]" and len(err.details()) < 300
    healthy(srv)


def test_reducers_per_tap_and_sampled_elements_are_bounded(stubs) -> None:
    srv, tel, _ = stubs
    many = [pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES, quantiles=pb.QuantileParams(probabilities=[i / 100]))
            for i in range(1, 18)]
    err = refused(tel.CreateTap, pb.CreateTapRequest(spec=pb.TapSpec(selector="layer1", reducers=many)))
    assert field_of(err) == "spec.reducers" and "at most 16" in err.details()
    big = [pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM, histogram=pb.HistogramParams(bins=8, sample_size=1 << 20)),
           pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES, quantiles=pb.QuantileParams(sample_size=1 << 19))]
    err = refused(tel.CreateTap, pb.CreateTapRequest(spec=pb.TapSpec(selector="layer1", reducers=big)))
    assert field_of(err) == "spec.reducers" and "1572864" in err.details()
    # The same two sharing one sample size are within budget.
    big[1].quantiles.sample_size = 1 << 20
    tap = tel.CreateTap(pb.CreateTapRequest(spec=pb.TapSpec(selector="layer1", reducers=big)), timeout=10).tap
    tel.DeleteTap(pb.DeleteTapRequest(id=tap.id), timeout=10)
    healthy(srv)


@pytest.mark.parametrize("seconds", [3e11, 30 * 24 * 3600 + 1, -1, 86_400_000_000_000, 1 << 62, -(1 << 62)])
def test_ttl_is_bounded_and_a_refused_tap_leaves_nothing(stubs, seconds) -> None:
    srv, tel, _ = stubs
    req = pb.CreateTapRequest(spec=pb.TapSpec(selector="layer1", reducers=moments()))
    req.ttl.seconds = int(seconds)  # beyond timedelta's range too (OverflowError in ToTimedelta)
    err = refused(tel.CreateTap, req)
    assert field_of(err) == "ttl"
    assert tel.ListTaps(pb.ListTapsRequest(), timeout=5).taps == []  # ListTaps keeps working
    healthy(srv)


@pytest.mark.parametrize("field, value", [("probability", math.nan), ("probability", math.inf),
                                          ("max_per_second", math.nan), ("max_per_second", math.inf)])
def test_nan_and_infinite_sampling_is_refused(stubs, field, value) -> None:
    srv, tel, _ = stubs
    sampling = pb.Sampling(**{field: value})
    err = refused(tel.CreateTap, pb.CreateTapRequest(spec=pb.TapSpec(selector="layer1", reducers=moments(),
                                                                     sampling=sampling)))
    assert field_of(err) == f"spec.sampling.{field}"
    healthy(srv)


@pytest.mark.parametrize("shape", [[0, 1 << 62, 1 << 62], [1] * 17, [0, -1]])
def test_absurd_shapes_are_refused_before_any_allocation(stubs, shape) -> None:
    srv, _, inf = stubs
    t = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=shape, raw_data=b"")
    err = refused(inf.Infer, ipb.InferRequest(inputs=[t]))
    assert field_of(err) == "inputs[0].shape"
    healthy(srv)


class Lookup(torch.nn.Module):
    """An embedding (raises IndexError on an out-of-range id) and a head forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.unused_head = torch.nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


@pytest.fixture
def lookup(make_server):
    srv = make_server(LoadedModel(Lookup(), "lookup", "factory", [InputSpec("ids", torch.int64, (-1,))]))
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        yield srv, client


def test_a_forward_that_raises_on_the_input_is_invalid_argument(lookup) -> None:
    _, client = lookup
    with pytest.raises(layertap.InvalidArgument, match=r"model raised IndexError: index out of range") as info:
        client.infer(np.array([1, 50], np.int64))
    assert info.value.field == "inputs"
    assert client.infer(np.array([1, 2], np.int64)).shape == (2, 4)  # the server is fine


def test_capturing_a_module_that_did_not_run_is_failed_precondition(lookup) -> None:
    _, client = lookup
    with pytest.raises(layertap.FailedPrecondition, match="'unused_head' did not run") as info:
        client.capture(["embed", "unused_head"], input=np.array([1, 2], np.int64))
    assert info.value.field == "layers[1]"
    assert client.stats().active_hooks == 0


@pytest.mark.parametrize("n", [6000, 100_000])
def test_long_unknown_tap_ids_answer_not_found(stubs, n) -> None:
    srv, tel, _ = stubs
    err = refused(tel.DeleteTap, pb.DeleteTapRequest(id="x" * n), code=grpc.StatusCode.NOT_FOUND)
    assert len(err.details()) < 300
    with layertap.Client(f"127.0.0.1:{srv.port}") as client, pytest.raises(layertap.NotFound):
        client.delete_tap("x" * n)
    healthy(srv)
