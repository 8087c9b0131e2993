"""Protobuf messages <-> the client's dataclasses, and the request builders: one import for all of them.

Everything that reads or builds a ``layertap.v1`` message lives here and in
the per-resource modules this one gathers (``_convert_taps``,
``_convert_summaries``, ``_convert_drift``, over ``_convert_base``), or in
:mod:`layertap._codec` (tensor bytes) and :mod:`layertap._capture` (capture
streams); the rest of the client sees numpy arrays, torch tensors and the
dataclasses of :mod:`layertap._types`. This module keeps the inference,
layer and stats converters, which have no resource module of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._codec import TensorValue, decode_tensor, dtype_name, encode_tensor
from ._convert_base import POINT_NAMES, derive_code, phase_code, phase_name, point_code, point_name
from ._convert_base import from_fields as _from_fields
from ._convert_drift import baseline_from_proto, drift_from_proto, set_baseline_request
from ._convert_summaries import _RESULT_TYPES as _RESULT_TYPES  # tests check summary_from_proto kind by kind
from ._convert_summaries import SubscribeBatch, subscribe_batch_from_proto, summary_from_proto
from ._convert_taps import (
    REDUCER_NAMES,
    REDUCER_PARAMS,
    create_tap_request,
    reducer_from_proto,
    reducer_to_proto,
    subscribe_request,
    tap_info_from_proto,
    tap_spec_from_proto,
    tap_spec_to_proto,
)
from ._types import LayerInfo, ModelMetadata, ServerStats, TensorSpec
from .v1 import inference_pb2, telemetry_pb2

__all__ = [
    # enums
    "POINT_NAMES", "REDUCER_NAMES", "REDUCER_PARAMS", "derive_code", "phase_code", "phase_name", "point_code",
    "point_name",
    # inference, layers, stats
    "infer_outputs", "infer_request", "layers_from_proto", "metadata_from_proto", "stats_from_proto",
    # taps
    "create_tap_request", "reducer_from_proto", "reducer_to_proto", "subscribe_request", "tap_info_from_proto",
    "tap_spec_from_proto", "tap_spec_to_proto",
    # summaries
    "SubscribeBatch", "subscribe_batch_from_proto", "summary_from_proto",
    # drift
    "baseline_from_proto", "drift_from_proto", "set_baseline_request",
]


# --------------------------------------------------------------------------- inference


def infer_request(inputs: Sequence[Any]) -> inference_pb2.InferRequest:
    """Builds an InferRequest from positional inputs."""
    return inference_pb2.InferRequest(inputs=[encode_tensor(x) for x in inputs])


def infer_outputs(resp: inference_pb2.InferResponse, *, as_torch: bool) -> list[TensorValue]:
    """Decodes an InferResponse's outputs, in order."""
    return [decode_tensor(t, as_torch=as_torch) for t in resp.outputs]


def metadata_from_proto(m: inference_pb2.GetModelMetadataResponse) -> ModelMetadata:
    """Converts GetModelMetadataResponse."""
    inputs = [TensorSpec(s.name, dtype_name(s.dtype), tuple(s.shape), s.optional) for s in m.inputs]
    return _from_fields(ModelMetadata, m, dtype=dtype_name(m.dtype), inputs=inputs,
                        rank=m.rank if m.has_rank else None, world_size=m.world_size if m.has_rank else None)


# --------------------------------------------------------------------------- layers, stats


def layers_from_proto(resp: telemetry_pb2.ListLayersResponse) -> list[LayerInfo]:
    """Converts ListLayersResponse."""
    return [
        _from_fields(
            LayerInfo,
            layer,
            input_shapes=[tuple(s.dims) for s in layer.input_shapes],
            output_shapes=[tuple(s.dims) for s in layer.output_shapes],
        )
        for layer in resp.layers
    ]


def stats_from_proto(s: telemetry_pb2.GetServerStatsResponse) -> ServerStats:
    """Converts GetServerStatsResponse."""
    return _from_fields(ServerStats, s)
