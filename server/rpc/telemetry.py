"""``layertap.v1.TelemetryService``: one proto service, served by one servicer per resource.

- ``layers.py``: ListLayers, GetServerStats
- ``taps.py``: CreateTap, DeleteTap, ListTaps, Subscribe, Capture
- ``baselines.py``: SetBaseline, GetDrift, ExportBaseline, InstallBaseline
- ``incidents.py``: ListIncidents, GetIncident, DeleteIncident
- ``explain.py``: Explain

The wire sees one service: :func:`add_to_server` registers a single handler
table built from the proto's descriptor (see
:func:`~layertap.server.rpc.method_handlers.service_handlers`), so reflection
lists one ``TelemetryService`` and the interceptors key on the proto's method
paths and kinds, whichever servicer answers. A method the proto gains is
served by defining it on one servicer (its scope is the proto's
``required_scope`` option); until a servicer defines it the server does not start.
"""

from __future__ import annotations

import grpc

from layertap.server.rpc.baselines import BaselinesServicer
from layertap.server.rpc.explain import ExplainServicer
from layertap.server.rpc.incidents import IncidentsServicer
from layertap.server.rpc.layers import LayersServicer
from layertap.server.rpc.method_handlers import add_service, service_handlers
from layertap.server.rpc.state import StateBacked, StateCell

# Re-exported until tests/e2e/test_capture_budget.py imports it from taps.
from layertap.server.rpc.taps import TapsServicer
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["SERVICE", "SERVICERS", "TelemetryService", "add_to_server"]

SERVICE = pb.DESCRIPTOR.services_by_name["TelemetryService"]
#: The resources' servicers, each built from the server's state cell.
SERVICERS: tuple[type[StateBacked], ...] = (LayersServicer, TapsServicer, BaselinesServicer, IncidentsServicer,
                                            ExplainServicer)


class TelemetryService:
    """The servicers of ``TelemetryService`` and their handler table.

    Raises:
        ValueError: A method of the proto that no servicer, or two, define.
    """

    def __init__(self, cell: StateCell) -> None:
        self.servicers = tuple(make(cell) for make in SERVICERS)
        #: Method name -> handler, in the proto's order.
        self.handlers: dict[str, grpc.RpcMethodHandler] = service_handlers(SERVICE, self.servicers)


def add_to_server(service: TelemetryService, server: grpc.Server) -> None:
    """Register the service's one handler table, generic and by path, as the generated code does."""
    add_service(server, SERVICE, service.handlers)
