"""The flight recorder's incidents: list, fetch (reassembling chunks) and delete.

:class:`Incidents` is a sub-client, reached as ``client.incidents``: it makes
its calls through the client's transport (deadlines, token, error mapping).
``Incidents(client)``, the older spelling, returns that same sub-client.
Reading incidents needs the ``capture`` scope.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from ._capture import CaptureAssembler
from ._errors import ProtocolError
from ._transport import Streaming, Transport, Unary
from .v1 import telemetry_pb2

LIST_INCIDENTS = Unary.of("TelemetryService", "ListIncidents", telemetry_pb2.ListIncidentsRequest, telemetry_pb2.ListIncidentsResponse)
GET_INCIDENT = Streaming.of("TelemetryService", "GetIncident", telemetry_pb2.GetIncidentRequest, telemetry_pb2.GetIncidentResponse)
DELETE_INCIDENT = Unary.of("TelemetryService", "DeleteIncident", telemetry_pb2.DeleteIncidentRequest, telemetry_pb2.DeleteIncidentResponse)


@dataclass(frozen=True)
class IncidentInfo:
    """What fired, on which pass, and whether the replay reproduced it."""

    id: str
    tap: str
    triggers: tuple[str, ...]
    #: Layer -> the trigger names that fired there.
    layers: dict[str, tuple[str, ...]]
    #: Layer -> batch rows of the replayed tensor that held the anomaly.
    layer_rows: dict[str, tuple[int, ...]]
    rows: tuple[int, ...]
    pass_index: int
    #: Unix time of the pass.
    time: float
    replayed: bool
    replay_matches: bool
    replay_note: str
    bytes: int
    tensor_count: int
    tensors_dropped: int


@dataclass(frozen=True)
class Incident:
    """An incident with its tensors as numpy arrays (bfloat16 widened to float32).

    ``layers`` is keyed by layer name; a second call of a module in the pass,
    or a second tensor of a tuple output, gets ``name#call.index``.
    """

    info: IncidentInfo
    inputs: list[np.ndarray] = field(default_factory=list)
    layers: dict[str, np.ndarray] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write an ``.npz``: ``input_0``..., ``layer/<key>``..., and ``incident`` (JSON)."""
        arrays = {f"input_{i}": a for i, a in enumerate(self.inputs)}
        arrays.update({f"layer/{k}": a for k, a in self.layers.items()})
        meta = json.dumps(info_dict(self.info), sort_keys=True)
        np.savez(path, incident=np.array(meta), **arrays)  # type: ignore[arg-type]


def info_dict(info: IncidentInfo) -> dict[str, object]:
    """JSON-ready form of an :class:`IncidentInfo`."""
    return {
        "id": info.id, "tap": info.tap, "triggers": list(info.triggers),
        "layers": {k: list(v) for k, v in info.layers.items()},
        "layer_rows": {k: list(v) for k, v in info.layer_rows.items()}, "rows": list(info.rows),
        "pass_index": info.pass_index, "time": info.time, "replayed": info.replayed,
        "replay_matches": info.replay_matches, "replay_note": info.replay_note, "bytes": info.bytes,
        "tensor_count": info.tensor_count, "tensors_dropped": info.tensors_dropped,
    }


def info_from_proto(m: telemetry_pb2.Incident) -> IncidentInfo:
    return IncidentInfo(
        id=m.id, tap=m.tap, triggers=tuple(m.triggers),
        layers={x.layer: tuple(x.triggers) for x in m.layers},
        layer_rows={x.layer: tuple(x.rows) for x in m.layers}, rows=tuple(m.rows),
        pass_index=m.pass_index, time=m.time.ToNanoseconds() / 1e9, replayed=m.replayed,
        replay_matches=m.replay_matches, replay_note=m.replay_note, bytes=m.bytes,
        tensor_count=m.tensor_count, tensors_dropped=m.tensors_dropped,
    )


class _HasIncidents(Protocol):
    """A :class:`~layertap.Client`, as ``Incidents(client)`` sees it."""

    @property
    def incidents(self) -> Incidents: ...


class Incidents:
    """The incident ring of the server a :class:`~layertap.Client` talks to.

    Reached as ``client.incidents``; ``Incidents(client)`` is the same object.

    Example:
        >>> with layertap.Client("localhost:50051") as client:
        ...     for info in client.incidents.list():
        ...         print(info.id, info.tap, info.rows)
    """

    _transport: Transport

    def __new__(cls, client: _HasIncidents | Transport) -> Incidents:
        if not isinstance(client, Transport):
            return client.incidents  # the spelling Incidents(client): the client's own sub-client
        self = super().__new__(cls)
        self._transport = client
        return self

    def list(self, tap: str = "", *, timeout: float | None = None) -> list[IncidentInfo]:
        """Incidents, newest first (only ``tap``'s when given)."""
        resp = self._transport.unary(LIST_INCIDENTS, telemetry_pb2.ListIncidentsRequest(tap=tap), timeout=timeout)
        return [info_from_proto(m) for m in resp.incidents]

    def get(self, incident_id: str, *, timeout: float | None = None) -> Incident:
        """One incident with its input and captured tensors."""
        t = self._transport
        call = t.stream(GET_INCIDENT, telemetry_pb2.GetIncidentRequest(id=incident_id), timeout=timeout)
        with t.translating():
            try:
                return assemble(call)
            except BaseException:
                call.cancel()  # a stream that breaks the contract is not read on
                raise

    def delete(self, incident_id: str, *, timeout: float | None = None) -> None:
        """Removes one incident from the server's ring."""
        self._transport.unary(DELETE_INCIDENT, telemetry_pb2.DeleteIncidentRequest(id=incident_id), timeout=timeout)


def assemble(messages: Iterable[telemetry_pb2.GetIncidentResponse]) -> Incident:
    """GetIncident's stream -> an :class:`Incident`.

    The tensors are framed as a Capture stream's are (a header, then its
    chunks in order), so the capture's assembler checks them: every claim
    before any allocation, and no byte the server did not send.

    Raises:
        ProtocolError: No record first, a second record, or any breach of the
            capture framing (a chunk out of place, missing bytes, a header
            whose size disagrees with its dtype and shape).
    """
    stream = iter(messages)
    first = next(stream, None)
    if first is None or first.WhichOneof("payload") != "incident":
        raise ProtocolError("GetIncident: the stream did not start with the incident record")
    assembler = CaptureAssembler()
    for m in stream:
        if m.WhichOneof("payload") == "incident":
            raise ProtocolError("GetIncident: a second incident record in one stream")
        assembler.feed(m)
    inputs: list[np.ndarray] = []
    layers: dict[str, np.ndarray] = {}
    for t in assembler.finish():
        arr = np.asarray(t.value)
        if t.point == "input" and t.layer == "":
            inputs.append(arr)
        else:
            key = t.layer if (t.call_index, t.output_index) == (0, 0) else f"{t.layer}#{t.call_index}.{t.output_index}"
            if key in layers:
                raise ProtocolError(f"GetIncident: two tensors for {key!r}")
            layers[key] = arr
    return Incident(info_from_proto(first.incident), inputs, layers)
