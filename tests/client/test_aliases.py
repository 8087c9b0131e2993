"""The sub-clients and the older spellings that stay as their aliases.

``client.incidents`` (``Incidents(client)``), ``client.baselines``
(``client.set_baseline``, ``client.drift``) and ``client.explain`` all call
through the client's one transport: the same requests, deadlines, token,
error mapping and lifecycle, checked against a scripted server.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

import layertap
from layertap import ClientClosed, Incidents, InvalidArgument, NotFound
from layertap._codec import encode_tensor
from layertap._fleet_baseline import Baselines
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

pytestmark = pytest.mark.e2e


class Scripted(telemetry_pb2_grpc.TelemetryServiceServicer):
    """Answers the incident, baseline and explain RPCs; records what each call carried."""

    def __init__(self) -> None:
        #: (method, request, seconds left before the deadline or None, authorization header)
        self.calls: list[tuple[str, Any, float | None, str | None]] = []

    def _record(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        left = context.time_remaining()
        auth = dict(context.invocation_metadata()).get("authorization")
        self.calls.append((method, request, None if left is None or left > 1e6 else left, auth))

    def ListLayers(self, request: pb.ListLayersRequest, context: grpc.ServicerContext) -> pb.ListLayersResponse:
        return pb.ListLayersResponse(layers=[pb.LayerInfo(name="layer4"), pb.LayerInfo(name="fc")])

    def ListIncidents(self, request: pb.ListIncidentsRequest,
                      context: grpc.ServicerContext) -> pb.ListIncidentsResponse:
        self._record("ListIncidents", request, context)
        return pb.ListIncidentsResponse(incidents=[pb.Incident(id="i1", tap=request.tap or "guard", rows=[0])])

    def GetIncident(self, request: pb.GetIncidentRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.GetIncidentResponse]:
        self._record("GetIncident", request, context)
        yield pb.GetIncidentResponse(incident=pb.Incident(id=request.id, tap="guard"))

    def DeleteIncident(self, request: pb.DeleteIncidentRequest,
                       context: grpc.ServicerContext) -> pb.DeleteIncidentResponse:
        self._record("DeleteIncident", request, context)
        if request.id != "i1":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no incident {request.id!r}")
        return pb.DeleteIncidentResponse()

    def SetBaseline(self, request: pb.SetBaselineRequest, context: grpc.ServicerContext) -> pb.SetBaselineResponse:
        self._record("SetBaseline", request, context)
        return pb.SetBaselineResponse(tap=request.name or "baseline-x", layers=["layer4"])

    def GetDrift(self, request: pb.GetDriftRequest, context: grpc.ServicerContext) -> pb.GetDriftResponse:
        self._record("GetDrift", request, context)
        if request.selector == "nope":
            context.abort(grpc.StatusCode.NOT_FOUND, "selector 'nope' matches no layer")
        return pb.GetDriftResponse(layers=[pb.LayerDrift(tap="baseline-x", layer="layer4", psi=0.5)])

    def Explain(self, request: pb.ExplainRequest, context: grpc.ServicerContext) -> pb.ExplainResponse:
        self._record("Explain", request, context)
        maps = np.full((len(request.targets) or 1, 2, 2), 0.5, np.float32)
        return pb.ExplainResponse(maps=encode_tensor(maps), targets=list(request.targets) or [3], scores=[1.5])


@pytest.fixture()
def scripted(grpc_server: Callable[..., str]) -> tuple[Scripted, str]:
    servicer = Scripted()
    return servicer, grpc_server(telemetry=servicer)


@pytest.fixture()
def client(scripted: tuple[Scripted, str]) -> Iterator[layertap.Client]:
    with layertap.Client(scripted[1], timeout=20) as c:
        yield c


def _params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


# ---------------------------------------------------------------------- incidents


def test_incidents_of_a_client_is_its_sub_client(client: layertap.Client) -> None:
    assert isinstance(client.incidents, Incidents)
    assert Incidents(client) is client.incidents
    assert Incidents(client) is Incidents(client)


def test_both_incident_spellings_make_the_same_calls(scripted: tuple[Scripted, str],
                                                     client: layertap.Client) -> None:
    servicer, _ = scripted
    assert Incidents(client).list("mine") == client.incidents.list("mine")
    assert Incidents(client).get("i1") == client.incidents.get("i1")
    Incidents(client).delete("i1")
    client.incidents.delete("i1")
    methods = [(m, req) for m, req, _, _ in servicer.calls]
    assert methods == [
        ("ListIncidents", pb.ListIncidentsRequest(tap="mine")), ("ListIncidents", pb.ListIncidentsRequest(tap="mine")),
        ("GetIncident", pb.GetIncidentRequest(id="i1")), ("GetIncident", pb.GetIncidentRequest(id="i1")),
        ("DeleteIncident", pb.DeleteIncidentRequest(id="i1")), ("DeleteIncident", pb.DeleteIncidentRequest(id="i1")),
    ]
    (info,) = client.incidents.list()
    assert (info.id, info.tap, info.rows) == ("i1", "guard", (0,))
    assert client.incidents.get("i1").info.id == "i1"


def test_incident_errors_are_translated(client: layertap.Client) -> None:
    with pytest.raises(NotFound, match="no incident 'gone'"):
        client.incidents.delete("gone")
    with pytest.raises(NotFound):
        Incidents(client).delete("gone")


# ---------------------------------------------------------------------- baselines


def test_set_baseline_and_drift_are_aliases_of_the_baselines_sub_client(
    scripted: tuple[Scripted, str], client: layertap.Client
) -> None:
    servicer, _ = scripted
    assert isinstance(client.baselines, Baselines)
    assert _params(layertap.Client.set_baseline) == _params(Baselines.set)
    assert _params(layertap.Client.drift) == _params(Baselines.drift)

    kwargs: dict[str, Any] = dict(passes=7, window=3, point="input", thresholds={"psi": 0.3}, name="b1")
    old = client.set_baseline("layer*", **kwargs)
    new = client.baselines.set("layer*", **kwargs)
    assert old == new == layertap.BaselineInfo(tap="b1", layers=["layer4"])
    assert client.drift("layer4") == client.baselines.drift("layer4")
    assert client.drift()[0].psi == 0.5

    (m1, r1, _, _), (m2, r2, _, _), (m3, r3, _, _), (m4, r4, _, _) = servicer.calls[:4]
    assert (m1, m2, m3, m4) == ("SetBaseline", "SetBaseline", "GetDrift", "GetDrift")
    assert r1 == r2 and r1.passes == 7 and r1.window == 3 and r1.name == "b1" and not r1.hold
    assert r3 == r4 == pb.GetDriftRequest(selector="layer4")


def test_baseline_errors_are_translated(client: layertap.Client) -> None:
    with pytest.raises(NotFound) as old:
        client.drift("nope")
    with pytest.raises(NotFound) as new:
        client.baselines.drift("nope")
    assert str(old.value) == str(new.value)


# ---------------------------------------------------------------------- explain


def test_explain_is_a_method_with_its_old_signature(scripted: tuple[Scripted, str],
                                                    client: layertap.Client) -> None:
    servicer, _ = scripted
    assert "explain" in vars(layertap.Client) and inspect.isfunction(vars(layertap.Client)["explain"])
    assert _params(layertap.Client.explain) == [
        ("x", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        # Optional since the input methods (integrated gradients, saliency) take none; Grad-CAM still needs it.
        ("layer", inspect.Parameter.POSITIONAL_OR_KEYWORD, None),
        ("target", inspect.Parameter.POSITIONAL_OR_KEYWORD, None),
        ("method", inspect.Parameter.KEYWORD_ONLY, "grad_cam"),  # added with Captum's methods: keyword-only
        ("normalize", inspect.Parameter.KEYWORD_ONLY, False),
        ("upsample", inspect.Parameter.KEYWORD_ONLY, False),
        ("output_name", inspect.Parameter.KEYWORD_ONLY, ""),  # added with structured outputs: keyword-only
        ("n_steps", inspect.Parameter.KEYWORD_ONLY, None),
        ("baseline", inspect.Parameter.KEYWORD_ONLY, None),
        ("noise_std", inspect.Parameter.KEYWORD_ONLY, None),
        ("seed", inspect.Parameter.KEYWORD_ONLY, None),
        ("internal_batch_size", inspect.Parameter.KEYWORD_ONLY, None),
        ("timeout", inspect.Parameter.KEYWORD_ONLY, None),
    ]
    found = client.explain(np.zeros((2, 3), np.float32), "layer4", [1, 2], normalize=True)
    assert isinstance(found, layertap.Explanation)
    assert (found.layer, found.classes, found.scores, found.maps.shape) == ("layer4", [1, 2], [1.5], (2, 2, 2))
    (method, req, _, _), = servicer.calls
    assert method == "Explain" and list(req.targets) == [1, 2] and req.normalize and not req.upsample


# ---------------------------------------------------------------------- what the transport gives every call


def test_every_sub_client_call_has_the_default_deadline_or_its_own(scripted: tuple[Scripted, str],
                                                                   client: layertap.Client) -> None:
    servicer, _ = scripted
    x = np.zeros((1, 3), np.float32)
    client.incidents.list()
    client.baselines.drift()
    client.explain(x, "layer4")
    defaults = [left for _, _, left, _ in servicer.calls]  # gRPC rounds the deadline up a little
    assert all(left is not None and 10 < left <= 21 for left in defaults), defaults
    servicer.calls.clear()
    client.incidents.list(timeout=2)
    client.drift(timeout=2)
    client.explain(x, "layer4", timeout=2)
    client.incidents.get("i1", timeout=2)
    overrides = [left for _, _, left, _ in servicer.calls]
    assert all(left is not None and left <= 3 for left in overrides), overrides
    servicer.calls.clear()
    client.incidents.list(timeout=math.inf)
    assert servicer.calls[0][2] is None
    for call in (lambda: client.incidents.list(timeout=0), lambda: client.baselines.drift(timeout=-1),
                 lambda: client.explain(x, "layer4", timeout=0)):
        with pytest.raises(InvalidArgument, match="timeout must be > 0"):
            call()


def test_every_sub_client_call_carries_the_token(scripted: tuple[Scripted, str]) -> None:
    servicer, target = scripted
    with layertap.Client(target, token="s3cret") as c:
        c.incidents.list()
        c.incidents.get("i1")
        c.set_baseline("layer4")
        c.explain(np.zeros((1, 3), np.float32), "layer4")
    assert [auth for _, _, _, auth in servicer.calls] == ["Bearer s3cret"] * 4


def test_after_close_every_spelling_raises_client_closed(scripted: tuple[Scripted, str]) -> None:
    servicer, target = scripted
    c = layertap.Client(target)
    incidents = c.incidents
    c.close()
    calls: list[Callable[[], object]] = [
        lambda: c.incidents.list(), lambda: incidents.get("i1"), lambda: Incidents(c).delete("i1"),
        lambda: c.baselines.set("layer4"), lambda: c.set_baseline("layer4"),
        lambda: c.baselines.drift(), lambda: c.drift(),
        lambda: c.explain(np.zeros((1, 3), np.float32), "layer4"),
    ]
    for call in calls:
        with pytest.raises(ClientClosed, match="is closed; create a new one"):
            call()
    with pytest.raises(ClientClosed):
        with c:
            pass
    assert c.closed and "closed" in repr(c)
    assert servicer.calls == []
