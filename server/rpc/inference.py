"""``layertap.v1.InferenceService``: Infer and GetModelMetadata."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from layertap.server.codec import flatten_outputs, tensor_from_proto, tensor_to_proto, wire_dtype
from layertap.server.errors import InvalidField, LimitExceeded, grpc_errors, status_for
from layertap.server.host.inputs import ModelInputs
from layertap.server.rpc.generate import generate
from layertap.server.rpc.state import ServerState, StateBacked
from layertap.v1 import inference_pb2 as ipb
from layertap.v1 import inference_pb2_grpc, tensor_pb2

API_VERSION = "layertap.v1"


def decode_inputs(inputs: list[tensor_pb2.Tensor], state: ServerState, field: str = "inputs") -> ModelInputs:
    """Wire tensors -> validated CPU tensors bound to the model's inputs, enforcing the request byte cap.

    A tensor's ``name`` binds it to the declared input of that name, passed
    to ``forward`` as a keyword; unnamed tensors are positional and come first.

    Each tensor's bytes are copied once (reading ``raw_data`` copies, so it is
    read once) and the tensors are views of those copies; the model host
    moves them to the device under its lock (``ModelHost.run``).
    """
    raws = [t.raw_data for t in inputs]
    total = sum(len(r) for r in raws)
    if total > state.config.max_request_bytes:
        raise LimitExceeded(
            f"request carries {total} tensor bytes, over --max-request-bytes={state.config.max_request_bytes}",
            field=field, metadata={"max_bytes": str(state.config.max_request_bytes)},
        )
    tensors = [tensor_from_proto(t, f"{field}[{i}]", raw) for i, (t, raw) in enumerate(zip(inputs, raws))]
    return state.host.validate_inputs([(t.name, x) for t, x in zip(inputs, tensors)], field)


class InferenceService(StateBacked, inference_pb2_grpc.InferenceServiceServicer):
    """Runs the hosted model."""

    @grpc_errors
    def Infer(self, request: ipb.InferRequest, context: grpc.ServicerContext) -> ipb.InferResponse:
        metrics = self.state.metrics
        start = time.perf_counter()
        status = "OK"
        try:
            # Serving work from here to the response: a background compile waits meanwhile (host.step_aside).
            with self.state.passes.serving():
                return self._infer(request)
        except Exception as exc:
            status = status_for(exc)[0].name
            raise
        finally:
            if metrics is not None:
                metrics.record_inference(status, time.perf_counter() - start)

    def _infer(self, request: ipb.InferRequest) -> ipb.InferResponse:
        if not request.inputs:
            raise InvalidField("inputs", "send at least one input tensor (see GetModelMetadata)")
        tensors = decode_inputs(list(request.inputs), self.state)
        out, ctx = self.state.host.run(tensors)
        flat = flatten_outputs(out)
        return ipb.InferResponse(
            outputs=[tensor_to_proto(t, name) for name, t in flat.tensors], pass_index=ctx.index,
            structure=flat.structure,
            skipped=[ipb.SkippedOutput(name=name, type=kind) for name, kind in flat.skipped])

    @grpc_errors
    def Generate(self, request: ipb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[ipb.GenerateResponse]:
        yield from generate(self.state, request, context)

    @grpc_errors
    def GetModelMetadata(self, request: ipb.GetModelMetadataRequest, context: grpc.ServicerContext) -> ipb.GetModelMetadataResponse:
        host = self.state.host
        return ipb.GetModelMetadataResponse(
            model_name=host.loaded.name,
            source=host.loaded.source,
            device=str(host.device),
            dtype=wire_dtype(host.dtype),
            parameter_count=host.parameter_count,
            inputs=[tensor_pb2.TensorSpec(name=s.name, dtype=wire_dtype(s.dtype), shape=list(s.shape), optional=not s.required)
                    for s in host.inputs],
            server_version=self.state.version,
            api_version=API_VERSION,
            active_hooks=host.hooks.active,
            hooks_supported=host.loaded.hooks_supported,
            **({"rank": host.rank[0], "world_size": host.rank[1], "has_rank": True} if host.rank else {}),
        )
