"""ListLayers and GetServerStats: what the hosted model has, and what the server is doing."""

from __future__ import annotations

import grpc

from layertap.server.errors import grpc_errors
from layertap.server.rpc.state import StateBacked
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import tensor_pb2

__all__ = ["LayersServicer"]


class LayersServicer(StateBacked):
    """The model's layers (names, types, shapes seen) and the server's counters."""

    @grpc_errors
    def ListLayers(self, request: pb.ListLayersRequest, context: grpc.ServicerContext) -> pb.ListLayersResponse:
        host = self.state.host
        host.arm_shape_probe()
        layers = []
        for name in host.layer_names:
            module = host.modules[name]
            shapes = host.layer_shapes.get(name)
            layers.append(pb.LayerInfo(
                name=name,
                type=type(module).__name__,
                parameter_count=sum(p.numel() for p in module.parameters()),
                input_shapes=[tensor_pb2.Shape(dims=list(s)) for s in (shapes.inputs if shapes else [])],
                output_shapes=[tensor_pb2.Shape(dims=list(s)) for s in (shapes.outputs if shapes else [])],
            ))
        return pb.ListLayersResponse(layers=layers, active_hooks=host.hooks.active)

    @grpc_errors
    def GetServerStats(self, request: pb.GetServerStatsRequest, context: grpc.ServicerContext) -> pb.GetServerStatsResponse:
        return self.state.stats()
