"""Explain: Grad-CAM maps of the caller's input at one layer."""

from __future__ import annotations

import grpc

from layertap.server.codec import tensor_to_proto
from layertap.server.errors import InvalidField, grpc_errors, unknown_layer
from layertap.server.explain.gradcam import GradCamOptions, grad_cam, require_hooks
from layertap.server.rpc.inference import decode_inputs
from layertap.server.rpc.state import ServerState, StateBacked
from layertap.server.taps.capture_options import MAX_LAYER_NAME
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["ExplainServicer", "explain_options"]


def explain_options(request: pb.ExplainRequest, state: ServerState) -> GradCamOptions:
    """Check the request's layer and targets against the model, before the inputs are decoded."""
    if not request.inputs:
        raise InvalidField("inputs", "send the input to explain (see GetModelMetadata)")
    name = request.layer
    if not name:
        raise InvalidField("layer", "name the layer to explain, e.g. the last convolutional block (see ListLayers)")
    if len(name) > MAX_LAYER_NAME:
        raise InvalidField("layer", f"a layer name is at most {MAX_LAYER_NAME} characters, got {len(name)}")
    host = state.host
    require_hooks(host)  # before the name: a TorchScript model lists no modules
    if name not in host.modules:
        raise unknown_layer(name, host.layer_names, field="layer")
    return GradCamOptions(name, tuple(request.targets), request.normalize, request.upsample, request.output_name)


class ExplainServicer(StateBacked):
    """Which parts of an input a layer's activations answer to, for the chosen targets."""

    @grpc_errors
    def Explain(self, request: pb.ExplainRequest, context: grpc.ServicerContext) -> pb.ExplainResponse:
        # Same byte cap, shape and dtype checks as Infer; a training agent refuses here.
        opts = explain_options(request, self.state)
        inputs = decode_inputs(list(request.inputs), self.state)
        found = self.state.host.on_model_thread(grad_cam, self.state.host, inputs, opts)
        return pb.ExplainResponse(maps=tensor_to_proto(found.maps, "maps"), targets=found.targets.tolist(),
                                  scores=found.scores.tolist())
