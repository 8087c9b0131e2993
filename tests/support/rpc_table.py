"""One row per RPC: the example requests its tests send. Everything else comes from the protos.

The RPCs themselves, whether each streams, and the scope each needs are read
from the services' descriptors and their ``(required_scope)`` option. A row
here is optional: an RPC without one still gets an auth probe (its empty
request), hostile cases drawn from its request's descriptor, and a default
share of the hostile suite. So a new RPC is covered the moment its proto
lands; a row only sharpens what is sent (valid requests the demo model
answers with OK, hand-picked extremes, a larger share).
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from layertap.v1 import inference_pb2 as ipb
from layertap.v1 import telemetry_pb2 as pb
from support.hostile import (
    DOUBLES,
    HEALTH,
    INFERENCE,
    NAMES,
    SELECTORS,
    TELEMETRY,
    VALID_SELECTORS,
    Rpc,
    _capture,
    _create_tap,
    _empty,
    _explain,
    _health,
    _set_baseline,
    _subscribe,
    cases,
    hostile,
    tensors,
    valid_input,
    weighted,
)

__all__ = ["DEFAULT_SHARE", "EXAMPLES", "RPCS", "SHARES", "Examples", "methods", "probe"]

#: Hostile cases per run for an RPC without a row of its own.
DEFAULT_SHARE = 10


@dataclass(frozen=True)
class Examples:
    """What an RPC's tests send, where the defaults are not enough."""

    #: The auth probe: fails fast past the interceptor (or succeeds), never waits for traffic. None: empty.
    probe: Message | None = None
    #: Requests the demo model must answer with OK; None: every case is a refusal.
    valid: st.SearchStrategy[Message] | None = None
    #: Weighted hostile strategies; empty: random messages of the request's descriptor.
    bad: tuple[tuple[int, st.SearchStrategy[Message]], ...] = ()
    #: Cases per run of the hostile suite (``benchmarks/fuzz.py`` scales them).
    share: int = DEFAULT_SHARE


def methods() -> dict[str, MethodDescriptor]:
    """Every RPC of every service the server hosts, by ``Service.Method``, from the descriptors."""
    files = (ipb.DESCRIPTOR, pb.DESCRIPTOR, health_pb2.DESCRIPTOR)
    return {f"{s.name}.{m.name}": m for f in files for s in f.services_by_name.values() for m in s.methods}


def _hostile(cls: type[Message]) -> st.SearchStrategy[Message]:
    return hostile(cls.DESCRIPTOR)


def _examples() -> dict[str, Examples]:
    infer, tel, health = INFERENCE.rsplit(".", 1)[1], TELEMETRY.rsplit(".", 1)[1], HEALTH.rsplit(".", 1)[1]
    missing_incident = "inc-0000000000001-00000000"
    return {
        f"{infer}.Infer": Examples(
            ipb.InferRequest(), st.builds(ipb.InferRequest, inputs=valid_input().map(lambda t: [t])),
            ((3, st.builds(ipb.InferRequest, inputs=tensors())), (1, _hostile(ipb.InferRequest))), 90),
        # The demo CNN cannot generate: every Generate is refused (FAILED_PRECONDITION), whatever it holds.
        f"{infer}.Generate": Examples(ipb.GenerateRequest(prompts=[ipb.TokenIds(ids=[1])]), share=20),
        f"{infer}.GetModelMetadata": Examples(valid=st.builds(ipb.GetModelMetadataRequest),
                                              bad=((1, _empty(ipb.GetModelMetadataRequest)),), share=30),
        f"{tel}.ListLayers": Examples(valid=st.builds(pb.ListLayersRequest),
                                      bad=((1, _empty(pb.ListLayersRequest)),), share=30),
        f"{tel}.Capture": Examples(valid=_capture(True), bad=((3, _capture(False)), (1, _hostile(pb.CaptureRequest))),
                                   share=140),
        f"{tel}.CreateTap": Examples(valid=_create_tap(True), share=120,
                                     bad=((3, _create_tap(False)), (1, _hostile(pb.CreateTapRequest)))),
        f"{tel}.DeleteTap": Examples(pb.DeleteTapRequest(id="no-such-tap"), share=60,
                                     bad=((3, st.builds(pb.DeleteTapRequest, id=NAMES)), (1, _hostile(pb.DeleteTapRequest)))),
        f"{tel}.ListTaps": Examples(valid=st.builds(pb.ListTapsRequest), bad=((1, _empty(pb.ListTapsRequest)),), share=30),
        f"{tel}.Subscribe": Examples(pb.SubscribeRequest(tap_ids=["no-such-tap"]), _subscribe(True),
                                     ((3, _subscribe(False)), (1, _hostile(pb.SubscribeRequest))), 110),
        f"{tel}.SetBaseline": Examples(pb.SetBaselineRequest(selector="no-such-layer"), _set_baseline(True),
                                       ((3, _set_baseline(False)), (1, _hostile(pb.SetBaselineRequest))), 90),
        f"{tel}.GetDrift": Examples(
            valid=st.builds(pb.GetDriftRequest, selector=st.one_of(st.just(""), VALID_SELECTORS)),
            bad=((3, st.builds(pb.GetDriftRequest, selector=SELECTORS)), (1, _hostile(pb.GetDriftRequest))), share=80),
        # Baseline taps named at random (almost) never exist: refusals, mostly.
        f"{tel}.ExportBaseline": Examples(pb.ExportBaselineRequest(tap="no-such-tap")),
        f"{tel}.InstallBaseline": Examples(pb.InstallBaselineRequest(tap="no-such-tap")),
        # Any double, the bounds' neighbours among them: INVALID_ARGUMENT naming `rate` outside [1e-12, 0.5].
        # Rate 0 is the probe: refused past the interceptor, it changes nothing.
        f"{tel}.SetDriftFalseAlarmRate": Examples(
            pb.SetDriftFalseAlarmRateRequest(rate=0.0), st.builds(pb.SetDriftFalseAlarmRateRequest, rate=st.floats(1e-12, 0.5)),
            ((3, st.builds(pb.SetDriftFalseAlarmRateRequest, rate=weighted(
                (3, DOUBLES), (1, st.sampled_from([0.0, -0.0, 9.99e-13, 0.5000001, 5e-324, 1.0, 1e300]))))),
             (1, _hostile(pb.SetDriftFalseAlarmRateRequest)))),
        f"{tel}.Explain": Examples(pb.ExplainRequest(layer="no-such-layer"), _explain(True),
                                   ((3, _explain(False)), (1, _hostile(pb.ExplainRequest))), 30),
        f"{tel}.GetServerStats": Examples(valid=st.builds(pb.GetServerStatsRequest),
                                          bad=((1, _empty(pb.GetServerStatsRequest)),), share=30),
        # The hostile suite's server has no --incident-dir: none of these can be OK.
        f"{tel}.GetIncident": Examples(pb.GetIncidentRequest(id=missing_incident)),
        f"{tel}.DeleteIncident": Examples(pb.DeleteIncidentRequest(id=missing_incident)),
        f"{health}.Check": Examples(valid=_health(True), share=40,
                                    bad=((2, _health(False)), (1, _hostile(health_pb2.HealthCheckRequest)))),
        f"{health}.Watch": Examples(valid=_health(True), bad=((2, _health(False)),), share=20),
        # grpcio's HealthServicer leaves List unimplemented: nothing here can be OK.
        f"{health}.List": Examples(bad=((1, _empty(health_pb2.HealthListRequest)),), share=20),
    }


#: The rows: only the RPCs whose tests send more than the defaults.
EXAMPLES: dict[str, Examples] = _examples()


def request_class(method: MethodDescriptor) -> type[Message]:
    """The request message class of an RPC."""
    return message_factory.GetMessageClass(method.input_type)


def probe(name: str) -> Message:
    """The auth probe of ``Service.Method``: its row's, else the empty request."""
    row = EXAMPLES.get(name)
    if row is not None and row.probe is not None:
        return row.probe
    return request_class(methods()[name])()


def _table() -> dict[str, Rpc]:
    out: dict[str, Rpc] = {}
    for name, method in methods().items():
        row = EXAMPLES.get(name, Examples())
        bad = row.bad or ((1, hostile(method.input_type)),)
        out[name] = Rpc(method.containing_service.full_name, method.name, method.server_streaming,
                        cases(name, row.valid, *bad))
    return out


#: Every RPC of every service the server hosts, by ``Service.Method``.
RPCS: dict[str, Rpc] = _table()
#: Cases per run, by RPC: weighted toward the RPCs with the most fields and state.
SHARES: dict[str, int] = {name: EXAMPLES.get(name, Examples()).share for name in RPCS}
