"""Helpers shared by the end-to-end tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def batch(n: int = 4, seed: int = 1) -> np.ndarray:
    """A deterministic demo-model input batch."""
    return np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32)


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Poll ``cond`` until true or ``timeout`` seconds pass (generous: a busy machine is slow, not wrong)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` over HTTP, parsed with prometheus-client's parser: ``{sample name: value}``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def rich_details(exc: BaseException) -> tuple[Any, list[tuple[str, str]]]:
    """The ErrorInfo and BadRequest violations of a raw grpc.RpcError, as any gRPC client reads them."""
    import grpc
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    assert isinstance(exc, grpc.RpcError)
    status = rpc_status.from_call(exc)  # also checks that code and message match the status
    assert status is not None, "the status carries no google.rpc.Status details"
    info, violations = error_details_pb2.ErrorInfo(), []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
    assert info.domain == "layertap.dev"
    return info, violations


def first_per_layer(stream: Any, layers: int) -> dict[str, Any]:
    """The first summary of each layer from a watch/subscribe stream, until ``layers`` layers were seen."""
    got: dict[str, Any] = {}
    for s in stream:
        got[s.layer] = s
        if len(got) == layers:
            break
    return got


def assert_basic_summaries(got: dict[str, Any], ref: dict[str, np.ndarray]) -> None:
    """Moments, minmax and nonfinite of each summary against the float64 reference output of its layer."""
    assert set(got) == set(ref)
    for name, s in got.items():
        r = ref[name]
        assert s.results["moments"].count == r.size
        np.testing.assert_allclose(s.results["moments"].mean, r.mean(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(s.results["moments"].std, r.std(), rtol=1e-9)
        assert s.results["minmax"].min == r.min() and s.results["minmax"].max == r.max()
        assert s.results["nonfinite"].nan_count == 0
