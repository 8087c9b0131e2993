"""Hostile requests for every RPC, written once for the test suite and the fuzz benchmark.

Each RPC gets one strategy of :class:`Case`: a request mixing three kinds of
message, so one run covers all of them:

* *random*: any field of the proto, drawn from its descriptor (unknown enum
  values, extreme ints, NaN/inf, huge strings and repeats, unknown fields);
* *extreme*: hand-picked shapes of trouble (2^62 dimensions, catastrophic
  selectors, byte counts that disagree with the shape);
* *valid*: requests the demo model must answer with OK, so the fuzzing never
  drifts into only testing refusals.

Sizes stay bounded so a run's memory does too: a string or bytes field is at
most ~1 MB, and repeats of a few thousand only ever hold small elements.
``tests/support/hostile_check.py`` sends the cases and judges the answers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import duration_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from layertap.server.app import SERVICE_NAMES
from layertap.server.host.demo_model import DemoResNet
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import tensor_pb2

INFERENCE = "layertap.v1.InferenceService"
TELEMETRY = "layertap.v1.TelemetryService"
HEALTH = "grpc.health.v1.Health"

#: Module names of the demo model, the valid selectors' vocabulary.
LAYERS: tuple[str, ...] = tuple(n for n, _ in DemoResNet().named_modules() if n)
#: Largest string or bytes field a case sends.
HUGE = 1 << 20
#: Elements in a "huge repeat" of one small value.
MANY = (100, 4000)


@dataclass(frozen=True)
class Case:
    """One request for one RPC; ``valid`` ones must be answered with OK."""

    rpc: str
    request: Message
    valid: bool

    def __repr__(self) -> str:  # hypothesis prints the falsifying case; keep it readable
        text = str(self.request)
        short = text if len(text) < 2000 else f"{text[:2000]}... ({len(text)} chars)"
        return f"Case({self.rpc}, valid={self.valid}, request=<{short}>)"


@dataclass(frozen=True)
class Rpc:
    """An RPC of a service: how to call it and the cases to send."""

    service: str
    method: str
    streaming: bool
    cases: st.SearchStrategy[Case]

    @property
    def name(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}.{self.method}"


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """``one_of`` with integer weights (hypothesis picks branches about evenly)."""
    pool = [s for w, s in choices for _ in range(w)]
    return st.sampled_from(pool).flatmap(lambda s: s)


# -- scalars -----------------------------------------------------------------
def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Any int in [lo, hi], often an edge: the bounds, 0, ±1, 2^31, 2^62."""
    edges = [lo, hi, 0, 1, -1, 2, (1 << 31) - 1, 1 << 31, 1 << 32, 1 << 62, -(1 << 62), hi // 2]
    return weighted((2, st.sampled_from(sorted({e for e in edges if lo <= e <= hi}))),
                    (2, st.integers(max(lo, -3), min(hi, 300))), (1, st.integers(lo, hi)))


INT32, INT64 = ints(-(1 << 31), (1 << 31) - 1), ints(-(1 << 63), (1 << 63) - 1)
UINT32, UINT64 = ints(0, (1 << 32) - 1), ints(0, (1 << 64) - 1)
DOUBLES = st.floats(allow_nan=True, allow_infinity=True)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
CHARS = st.characters(codec="utf-8")


def texts(big: bool = True) -> st.SearchStrategy[str]:
    """Short text, and (when ``big``) rarely one character repeated up to ~1 MB."""
    small = st.text(CHARS, max_size=40)
    if not big:
        return small
    huge = st.tuples(st.characters(codec="utf-8", min_codepoint=1), st.integers(1, HUGE)).map(
        lambda t: t[0] * (t[1] // len(t[0].encode("utf-8"))))
    return weighted((20, small), (1, huge))


def seeded_bytes(size: st.SearchStrategy[int]) -> st.SearchStrategy[bytes]:
    """Random bytes of a drawn size, from a drawn seed (cheap at any size)."""
    return st.tuples(st.integers(0, 2**32 - 1), size).map(
        lambda t: np.random.default_rng(t[0]).bytes(t[1]))


def blobs(big: bool = True) -> st.SearchStrategy[bytes]:
    small = st.binary(max_size=64)
    return weighted((20, small), (1, seeded_bytes(st.integers(0, HUGE)))) if big else small


def enums(field: FieldDescriptor) -> st.SearchStrategy[int]:
    """Defined values mostly, unknown ones (open proto3 enums) sometimes."""
    assert field.enum_type is not None
    return weighted((3, st.sampled_from(sorted(field.enum_type.values_by_number))), (1, INT32))


_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_INT32: INT32, FieldDescriptor.TYPE_SINT32: INT32, FieldDescriptor.TYPE_SFIXED32: INT32,
    FieldDescriptor.TYPE_INT64: INT64, FieldDescriptor.TYPE_SINT64: INT64, FieldDescriptor.TYPE_SFIXED64: INT64,
    FieldDescriptor.TYPE_UINT32: UINT32, FieldDescriptor.TYPE_FIXED32: UINT32,
    FieldDescriptor.TYPE_UINT64: UINT64, FieldDescriptor.TYPE_FIXED64: UINT64,
    FieldDescriptor.TYPE_DOUBLE: DOUBLES, FieldDescriptor.TYPE_FLOAT: FLOATS, FieldDescriptor.TYPE_BOOL: st.booleans(),
}


# -- random messages from descriptors -------------------------------------------
def _value(field: FieldDescriptor, depth: int, big: bool) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return random_message(field.message_type, depth + 1, big)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return enums(field)
    if field.type == FieldDescriptor.TYPE_STRING:
        return texts(big)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return blobs(big)
    return _SCALARS[field.type]


@functools.cache
def random_message(desc: Descriptor, depth: int = 0, big: bool = True) -> st.SearchStrategy[Message]:
    """Any message of type ``desc``: each field unset or random, to ``depth`` 3."""
    fields = [] if depth > 3 else list(desc.fields)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        from google.protobuf import message_factory

        msg = message_factory.GetMessageClass(desc)()
        for field in fields:
            if not draw(st.booleans()):
                continue
            if field.is_repeated:
                few = st.lists(_value(field, depth, big), max_size=3)
                # Only the outermost repeats grow: thousands of thousands would not be bounded.
                many = st.tuples(_value(field, depth, False), st.integers(*MANY)).map(lambda t: [t[0]] * t[1])
                getattr(msg, field.name).extend(draw(weighted((8, few), (1, many)) if big else few))
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, field.name).CopyFrom(draw(_value(field, depth, big)))
            else:
                setattr(msg, field.name, draw(_value(field, depth, big)))
        return msg

    return build()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def with_unknown_fields(draw: st.DrawFn, base: st.SearchStrategy[Message]) -> Message:
    """``base`` plus fields the schema does not have (or known numbers with the wrong wire type)."""
    msg = draw(base)
    for _ in range(draw(st.integers(1, 3))):
        number = draw(weighted((3, st.integers(1, 20)), (1, st.integers(1, (1 << 29) - 1))))
        if 19000 <= number <= 19999:  # reserved by protobuf itself
            continue
        if draw(st.booleans()):
            raw = _varint(number << 3) + _varint(draw(UINT64))
        else:
            payload = draw(blobs())
            raw = _varint(number << 3 | 2) + _varint(len(payload)) + payload
        try:
            msg.MergeFromString(raw)
        except DecodeError:  # e.g. bytes that are not a valid submessage: not sendable
            pass
    return msg


def hostile(desc: Descriptor) -> st.SearchStrategy[Message]:
    """Random messages of ``desc``, some with unknown fields."""
    return weighted((4, random_message(desc)), (1, with_unknown_fields(random_message(desc))))


# -- tensors -------------------------------------------------------------------
def valid_input(max_batch: int = 8) -> st.SearchStrategy[tensor_pb2.Tensor]:
    """A demo-model input: float32 [n, 3, 32, 32], any bit pattern (NaN/inf included) or normal values,
    unnamed (positional) or named ``x`` (the demo's forward parameter: any other name is refused)."""
    def build(t: tuple[int, int, bool, str]) -> tensor_pb2.Tensor:
        n, seed, raw, name = t
        rng = np.random.default_rng(seed)
        data = rng.bytes(n * 3 * 32 * 32 * 4) if raw else rng.standard_normal((n, 3, 32, 32), np.float32).tobytes()
        return tensor_pb2.Tensor(name=name, dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[n, 3, 32, 32], raw_data=data)
    return st.tuples(st.integers(0, max_batch), st.integers(0, 2**32 - 1), st.booleans(),
                     st.sampled_from(["", "x"])).map(build)


SHAPES = st.one_of(
    st.sampled_from([[0, 1 << 62, 1 << 62], [1 << 62], [1 << 62, 1 << 62], [(1 << 63) - 1], [-(1 << 63)], [0, -1],
                     [1] * 17, [0] * 5000, [1, 3, 32, 32], [0, 3, 32, 32], [1, 3, 32], [3, 32, 32, 1], [],
                     [1 << 31, 3, 32, 32], [2, 3, 1 << 40, 0], [1, 3, 64, 64]]),
    st.lists(INT64, max_size=20),
)


@st.composite
def extreme_tensor(draw: st.DrawFn) -> tensor_pb2.Tensor:
    """A tensor whose dtype, shape and byte count disagree in interesting ways."""
    shape = draw(SHAPES)
    dtype = draw(weighted((4, st.sampled_from(sorted(tensor_pb2.DataType.values()))), (1, INT32)))
    n = 1
    for d in shape:
        n *= max(d, 0)
    exact = n * 4 if 0 <= n * 4 <= HUGE else None
    sizes = [st.integers(0, 64), st.integers(0, HUGE)]
    if exact is not None:
        sizes += [st.just(exact)] * 3 + [st.sampled_from([max(exact - 1, 0), exact + 1])]
    data = draw(seeded_bytes(st.one_of(sizes)))
    return tensor_pb2.Tensor(name=draw(texts()), dtype=dtype, shape=shape, raw_data=data)


def tensors() -> st.SearchStrategy[list[tensor_pb2.Tensor]]:
    """Input lists: valid, extreme, random, empty or many."""
    one = weighted((2, valid_input()), (3, extreme_tensor()), (1, random_message(tensor_pb2.Tensor.DESCRIPTOR)))
    def crowd(t: tuple[tensor_pb2.Tensor, int]) -> list[tensor_pb2.Tensor]:
        small = tensor_pb2.Tensor(name=t[0].name[:64], dtype=t[0].dtype, shape=t[0].shape, raw_data=t[0].raw_data[:64])
        return [small] * t[1]  # many tensors, but small ones: a request stays under a few MB

    many = st.tuples(extreme_tensor(), st.integers(2, 300)).map(crowd)
    return weighted((6, st.lists(one, max_size=3)), (1, many))


# -- selectors, names, specs ---------------------------------------------------------
VALID_SELECTORS = st.one_of(st.sampled_from(LAYERS), st.sampled_from(
    ["layer*", "layer*.*", "**", "layer1.**", "re:layer[1-4]", "re:.*conv.*", "layer?.0", "*.0.bn?", "fc", "[cf]*"]))
BAD_SELECTORS = st.one_of(
    st.sampled_from(["**" * 30 + "!", "re:(.*)*(.*)*(.*)*!", "re:a{99999999999}", "re:a{1000}{1000}",
                     "re:" + "(" * 500 + "a" + ")" * 500, "re:(?P<x>a)(?P=x)", "re:(?=a)", "layer[z-a]", "layer[",
                     "[]", "[!]", "[\\]", "re:", "re:[", "x" * 1025, "é" * 600, "\x00", "re:\\C", "re:\\p{Greek}+",
                     "*" * 1024, "?" * 1024, "re:" + "a|" * 400 + "a", "re:(a*)*$", "\U0010ffff*", "layer1\n"]),
    texts(), st.text(st.sampled_from("*?[]!^.\\re:layer1"), max_size=60),
    st.text(st.sampled_from("*?[]!^.\\re:layer1"), max_size=60).map(lambda s: "re:" + s),
)
SELECTORS = weighted((2, VALID_SELECTORS), (3, BAD_SELECTORS))

_NAME_START = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
VALID_NAMES = st.tuples(st.sampled_from(_NAME_START), st.text(st.sampled_from(_NAME_START + "._:@/-"), max_size=255)
                        ).map("".join)
BAD_NAMES = st.one_of(st.sampled_from(["n" * 257, "../../etc/passwd", "tap name", "-x", ".x", "tap\x00", "é",
                                       "a" * HUGE]), texts())
NAMES = weighted((3, VALID_NAMES), (2, BAD_NAMES), (1, st.just("")))

#: Sample sizes that keep a valid tap's pass cheap (the cap itself is 2^20).
SAMPLE_SIZES = st.sampled_from([0, 1, 2, 7, 100, 4096, 16384])
PROBABILITY = st.floats(0.0, 1.0)


@st.composite
def valid_reducer(draw: st.DrawFn, kind: int) -> pb.ReducerSpec:
    spec = pb.ReducerSpec(kind=kind)  # type: ignore[arg-type]
    if kind == pb.REDUCER_KIND_HISTOGRAM and draw(st.booleans()):
        if draw(st.booleans()):
            edges = draw(st.lists(st.floats(-1e300, 1e300), min_size=1, max_size=1025, unique=True))
            spec.histogram.edges.extend(sorted(edges))
        else:
            lo = draw(st.floats(-1e6, 1e6))
            spec.histogram.bins = draw(st.integers(0, 1024))
            spec.histogram.min, spec.histogram.max = lo, lo + draw(st.floats(1.0, 1e6))
        spec.histogram.sample_size = draw(SAMPLE_SIZES)
    elif kind == pb.REDUCER_KIND_QUANTILES and draw(st.booleans()):
        spec.quantiles.probabilities.extend(draw(st.lists(PROBABILITY, max_size=128)))
        spec.quantiles.sample_size = draw(SAMPLE_SIZES)
    elif kind == pb.REDUCER_KIND_PER_CHANNEL and draw(st.booleans()):
        spec.per_channel.dim = draw(st.integers(-5, 5))
        spec.per_channel.max_channels = draw(st.integers(0, 4096))
    return spec


VALID_REDUCERS = st.lists(st.sampled_from(sorted(k for k in pb.ReducerKind.values() if k)), min_size=1,
                          unique=True).flatmap(lambda kinds: st.tuples(*[valid_reducer(k) for k in kinds])).map(list)
REDUCERS = weighted((3, VALID_REDUCERS), (2, st.lists(random_message(pb.ReducerSpec.DESCRIPTOR), max_size=4)),
                    (1, st.tuples(random_message(pb.ReducerSpec.DESCRIPTOR, big=False), st.integers(17, 3000))
                     .map(lambda t: [t[0]] * t[1])))
VALID_SAMPLING = st.builds(pb.Sampling, every_n=st.integers(0, (1 << 32) - 1), probability=PROBABILITY,
                           max_per_second=st.floats(0.0, 1e9))
SAMPLING = weighted((2, VALID_SAMPLING), (1, random_message(pb.Sampling.DESCRIPTOR)))
POINTS = weighted((4, st.sampled_from([0, 1, 2, 3, 4, 5])), (1, INT32))


def valid_spec(name: st.SearchStrategy[str] = weighted((1, VALID_NAMES), (1, st.just("")))
               ) -> st.SearchStrategy[pb.TapSpec]:
    return st.builds(pb.TapSpec, name=name, selector=VALID_SELECTORS, point=st.sampled_from([0, 1, 2, 3, 4, 5]),
                     reducers=VALID_REDUCERS, sampling=VALID_SAMPLING).map(_latency_at_output)


def _latency_at_output(spec: pb.TapSpec) -> pb.TapSpec:
    """The latency reducer times a forward: a valid spec that has it reads the output."""
    if any(r.kind == pb.REDUCER_KIND_LATENCY for r in spec.reducers):
        spec.point = pb.POINT_OUTPUT
    return spec


SPECS = weighted((2, valid_spec()), (1, random_message(pb.TapSpec.DESCRIPTOR)),
                 (3, st.builds(pb.TapSpec, name=NAMES, selector=SELECTORS, point=POINTS, reducers=REDUCERS,
                               sampling=SAMPLING)))


def durations(valid: bool) -> st.SearchStrategy[duration_pb2.Duration]:
    if valid:
        return st.builds(duration_pb2.Duration, seconds=st.integers(60, 30 * 24 * 3600 - 1),
                         nanos=st.integers(0, 999_999_999))
    return st.builds(duration_pb2.Duration, seconds=INT64, nanos=INT32)


# -- one strategy of cases per RPC ------------------------------------------------
def cases(rpc: str, valid: st.SearchStrategy[Message] | None,
          *bad: tuple[int, st.SearchStrategy[Message]]) -> st.SearchStrategy[Case]:
    """Valid requests (1 in 3 when there are any) mixed with weighted hostile ones."""
    branches = [(w, s.map(lambda r: Case(rpc, r, False))) for w, s in bad]
    if valid is not None:
        branches.append((sum(w for w, _ in bad) // 2 or 1, valid.map(lambda r: Case(rpc, r, True))))
    return weighted(*branches)


def _empty(cls: type[Message]) -> st.SearchStrategy[Message]:
    return with_unknown_fields(st.builds(cls))


def _capture(valid: bool) -> st.SearchStrategy[pb.CaptureRequest]:
    if valid:
        passive = st.builds(pb.CaptureRequest, layers=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=5),
                            point=st.sampled_from([0, 1, 2]), passes=st.integers(0, 16), max_batch=UINT32,
                            dtype=st.sampled_from([0, 2, 3]))
        active = st.builds(pb.CaptureRequest, layers=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=5),
                           point=st.sampled_from([0, 1, 2]), passes=st.integers(0, 1), max_batch=UINT32,
                           dtype=st.sampled_from([0, 2, 3]), inputs=valid_input(4).map(lambda t: [t]))
        return st.one_of(passive, active)
    layer_names = weighted((3, st.sampled_from(LAYERS)), (1, texts()),
                           (1, st.sampled_from(["", "q" * 100_000, "x" * 1025, "layer1 ", "LAYER1", ".", "re:.*"])))
    layer_lists = weighted((4, st.lists(layer_names, max_size=6)),
                           (1, st.tuples(st.one_of(st.sampled_from(LAYERS), texts(False)), st.integers(*MANY))
                            .map(lambda t: [t[0]] * t[1])))
    return st.builds(pb.CaptureRequest, layers=layer_lists, point=POINTS, passes=UINT32, inputs=tensors(),
                     max_batch=UINT32, dtype=weighted((3, st.sampled_from(range(11))), (1, INT32)))


def _create_tap(valid: bool) -> st.SearchStrategy[pb.CreateTapRequest]:
    if valid:
        return st.builds(pb.CreateTapRequest, spec=valid_spec(), ttl=st.one_of(st.none(), durations(True)),
                         forever=st.booleans())
    return st.builds(pb.CreateTapRequest, spec=SPECS, ttl=st.one_of(st.none(), durations(False)), forever=st.booleans())


def _subscribe(valid: bool) -> st.SearchStrategy[pb.SubscribeRequest]:
    if valid:
        named = st.lists(VALID_NAMES, max_size=3, unique=True).flatmap(
            lambda names: st.tuples(*[valid_spec(st.just(n)) for n in names]))
        return st.builds(pb.SubscribeRequest, stream_taps=st.one_of(named.map(list), valid_spec(st.just("")).map(
            lambda s: [s])), queue_size=st.integers(0, 65536))
    ids = weighted((3, st.lists(NAMES, max_size=3)), (1, st.tuples(texts(False), st.integers(*MANY))
                                                       .map(lambda t: [t[0]] * t[1])))
    # Past the tap limit (64): the taps already made for the stream must be rolled back.
    crowd = st.tuples(valid_spec(st.just("")), st.integers(2, 100)).map(lambda t: [t[0]] * t[1])
    return st.builds(pb.SubscribeRequest, tap_ids=ids, stream_taps=weighted((4, st.lists(SPECS, max_size=3)), (1, crowd)),
                     queue_size=UINT32)


def _set_baseline(valid: bool) -> st.SearchStrategy[pb.SetBaselineRequest]:
    if valid:
        thresholds = st.builds(pb.DriftThresholds, psi=st.floats(0, 1e300), js=st.floats(0, 1e300),
                               wasserstein=st.floats(0, 1e300), mean_shift=st.floats(0, 1e300))
        return st.builds(pb.SetBaselineRequest, selector=VALID_SELECTORS,
                         passes=weighted((4, st.integers(1, 3)), (1, st.integers(0, 100_000))),
                         point=st.sampled_from([0, 1, 2]), window=st.integers(0, 100_000), thresholds=thresholds,
                         sampling=VALID_SAMPLING, name=weighted((1, VALID_NAMES), (1, st.just(""))))
    return st.builds(pb.SetBaselineRequest, selector=SELECTORS, passes=UINT32, point=POINTS, window=UINT32,
                     thresholds=random_message(pb.DriftThresholds.DESCRIPTOR), sampling=SAMPLING, name=NAMES)


def _explain(valid: bool) -> st.SearchStrategy[pb.ExplainRequest]:
    if valid:  # a batch of at least one: Explain refuses an empty batch
        inputs = valid_input(4).filter(lambda t: t.shape[0] > 0).map(lambda t: [t])
        targets = st.lists(st.integers(0, 9), max_size=1)
        spatial = st.builds(pb.ExplainRequest, inputs=inputs, layer=st.sampled_from(["layer4", "layer3", "layer2.0"]),
                            targets=targets, normalize=st.booleans(), upsample=st.booleans())
        # fc's map has no spatial dims: upsampling it is the caller's bad argument (INVALID_ARGUMENT).
        dense = st.builds(pb.ExplainRequest, inputs=inputs, layer=st.just("fc"), targets=targets,
                          normalize=st.booleans())
        return weighted((3, spatial), (1, dense))
    layers = weighted((3, st.sampled_from(LAYERS)), (1, texts()), (1, st.sampled_from(["", "x" * 1025, "re:.*"])))
    return st.builds(pb.ExplainRequest, inputs=tensors(), layer=layers, targets=st.lists(INT64, max_size=10),
                     normalize=st.booleans(), upsample=st.booleans())


def _health(valid: bool) -> st.SearchStrategy[health_pb2.HealthCheckRequest]:
    if valid:
        return st.builds(health_pb2.HealthCheckRequest, service=st.sampled_from(["", *SERVICE_NAMES]))
    return st.builds(health_pb2.HealthCheckRequest, service=weighted((3, texts()), (1, st.sampled_from(
        [s + " " for s in SERVICE_NAMES] + ["grpc.health.v1.Health", "layertap.v1.*", "\x00"]))))
