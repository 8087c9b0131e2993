"""The latest per-layer telemetry, between the tap pipeline and the scrape.

The host-transfer thread writes summaries and drift scores; a scrape reads one
immutable copy, so it never sees a half-applied pass and never blocks taps
for longer than a dict copy. A layer's copy is rebuilt only after a write to
it, so an unchanged layer hands the scrape the very same object, which is how
the exporter knows to reuse its rendered lines.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import FieldDescriptor

from layertap._results import RESULTS
from layertap.server.drift.phases import FORWARD, phase_name
from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.host.hooks import POINT_NAMES
from layertap.server.protowire import uint64
from layertap.server.reducers.plan import BasicLayout as Layout
from layertap.server.reducers.spec import DEFAULT_PROBABILITIES
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["EXPORTED_QUANTILES", "LayerSnapshot", "SnapshotStore", "point_name"]

#: The only ``quantile`` label values exported: a bounded set, whatever
#: probabilities a tap computes (a drift baseline collects 99 of them).
EXPORTED_QUANTILES: frozenset[float] = frozenset(DEFAULT_PROBABILITIES)
_MAX_TOMBSTONES = 4096
#: A layer's key: (tap, layer, point, phase), label values all.
_Key = tuple[str, str, str, str]


def point_name(point: int) -> str:
    """``layertap.v1.Point`` value → label value (``POINT_OUTPUT`` → ``"output"``).

    ``POINT_UNSPECIFIED`` reads as ``"output"``, the API's default point; a
    value this build does not know keeps a bounded, readable label.
    """
    if point == pb.POINT_UNSPECIFIED:
        return "output"
    return POINT_NAMES.get(point, f"point_{int(point)}")


@dataclass(frozen=True, eq=False)
class LayerSnapshot:
    """The latest telemetry of one (tap, layer, point, phase); None means "not tapped", and the series is omitted.

    A prefill, a decode step and a plain forward (Infer) of one layer are
    three snapshots: their tensors differ in shape and distribution, so one
    never overwrites another's series (``phase``: see
    :mod:`layertap.server.drift.phases`).

    Attributes:
        histogram: ``(inner_edges, counts)`` with counts cumulative since the
            edges were set (``len(edges) + 1`` bins, open ends), or None.
        nan_total / inf_total: Cumulative non-finite element counts.
        last_update: Unix time of the latest summary for this layer.
        drift: The current drift scores; their thresholds are exported unless
            ``thresholds`` overrides them.
    """

    tap: str
    layer: str
    point: str
    phase: str = FORWARD
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    abs_max: float | None = None
    zero_fraction: float | None = None
    #: L2 norm of the finite elements (norm reducer): a gradient point's norm.
    l2: float | None = None
    quantiles: Mapping[float, float] | None = None
    nan_total: int | None = None
    inf_total: int | None = None
    last_update: float | None = None
    histogram: tuple[Sequence[float], Sequence[int] | npt.NDArray[np.int64]] | None = None
    drift: DriftScore | None = None
    thresholds: DriftThresholds | None = None
    channel_drift_fraction: float | None = None
    #: Seconds the module's forward took in the latest sampled pass (latency reducer).
    latency: float | None = None
    #: The logits reducer: entropy (nats), top-1 probability and top-1/top-2
    #: margin of the rows, their mean and the least confident row's.
    logits_entropy_mean: float | None = None
    logits_entropy_max: float | None = None
    logits_top1_mean: float | None = None
    logits_top1_min: float | None = None
    logits_margin_mean: float | None = None
    logits_margin_min: float | None = None

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.tap, self.layer, self.point, self.phase)


#: The fields that name a snapshot (its key); the others are its state.
_KEY_FIELDS = ("tap", "layer", "point", "phase")
_SNAPSHOT_FIELDS = tuple(f.name for f in fields(LayerSnapshot))
#: A layer's own fields; every other field but the key is a reducer result's.
_LAYER_FIELDS = ("last_update", "drift", "thresholds", "channel_drift_fraction")
_RESULT_FIELDS = tuple(name for r in RESULTS for name, _ in r.snapshot)
if _SNAPSHOT_FIELDS[:len(_KEY_FIELDS)] != _KEY_FIELDS or sorted(_SNAPSHOT_FIELDS) != sorted(
        (*_KEY_FIELDS, *_LAYER_FIELDS, *_RESULT_FIELDS)):
    raise ImportError(f"LayerSnapshot's fields and the result table (layertap._results) disagree: {_SNAPSHOT_FIELDS}")
#: A layer's state values in LayerSnapshot field order (after the key): one C call per snapshot.
_state_values = itemgetter(*_SNAPSHOT_FIELDS[len(_KEY_FIELDS):])
#: Oneof field -> how its result folds, and the (snapshot field, message field) pairs it writes.
_FOLDS = {r.field: (r.fold, r.snapshot) for r in RESULTS if r.snapshot}
#: What a sampled primary summary clears when it lacks the result: every
#: exported result but the counters.
_CLEARED = tuple((r.field, r.fold, tuple(name for name, _ in r.snapshot))
                 for r in RESULTS if r.snapshot and r.fold != "total")
#: Raw (tap, layer, point, phase) -> label key entries kept at most (one per durable layer and phase).
_MAX_KEYS = 4096
_FoldStep = tuple[int, str, str, tuple[tuple[str, str], ...]]


@functools.lru_cache(maxsize=256)  # one entry per distinct reducer set: a handful
def _fold_plan(kinds: tuple[str | None, ...]) -> tuple[tuple[tuple[tuple[str, ...], bool], ...], tuple[_FoldStep, ...]]:
    """What a summary whose results are ``kinds`` (oneof names, in order) clears when primary and
    sampled (snapshot fields, and whether the L2 pass sum goes too), and each exported result's
    (index, kind, fold, pairs)."""
    cleared = tuple((names, fold == "pass_l2") for kind, fold, names in _CLEARED if kind not in kinds)
    steps = tuple((i, kind, *_FOLDS[kind]) for i, kind in enumerate(kinds) if kind in _FOLDS)
    return cleared, steps  # type: ignore[return-value]  # _FOLDS' values are (fold, pairs)


#: The folds that read only a result's scalar fields: the only ones a basic reducer's result takes.
_SCALAR_FOLDS = frozenset({"total", "pass_l2", "latest"})
_BasicStep = tuple[Callable[..., tuple[float, ...]], int, int, tuple[int, ...], str,
                   tuple[tuple[str, int, Callable[[Any], Any]], ...]]


#: id(layout) -> (layout, its plan): looked up per piece per pass, so by identity, not by hashing the
#: nested tuple; the layout is held so its id is never reused while the entry lives.
_BASIC_PLANS: dict[int, tuple[Layout, tuple[tuple[str, ...], tuple[_BasicStep, ...]]]] = {}


def _basic_plan(layout: Layout) -> tuple[tuple[str, ...], tuple[_BasicStep, ...]]:
    """A basic layout's result kinds (as a summary lists them) and, per exported result, how its
    snapshot fields come from the reducer's numbers: the message field's position, and the type
    a parsed summary would give it (``int`` for a count, ``float`` otherwise)."""
    hit = _BASIC_PLANS.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    if len(_BASIC_PLANS) >= 1024:  # one entry per live plan; bounded as taps come and go
        _BASIC_PLANS.clear()
    plan = _make_basic_plan(layout)
    _BASIC_PLANS[id(layout)] = (layout, plan)
    return plan


def _make_basic_plan(layout: Layout) -> tuple[tuple[str, ...], tuple[_BasicStep, ...]]:
    kinds = tuple(r.result_field for r, _, _ in layout)
    steps: list[_BasicStep] = []
    for r, a, b in layout:
        message = pb.ReducerResult.DESCRIPTOR.fields_by_name[r.result_field].message_type
        assert message is not None
        counts = tuple(j for j, f in enumerate(message.fields) if f.type != FieldDescriptor.TYPE_DOUBLE)
        if r.result_field not in _FOLDS:
            steps.append((r.numbers, a, b, counts, "", ()))  # folds nothing (no pairs); its counts are still checked
            continue
        fold, pairs = _FOLDS[r.result_field]
        if fold not in _SCALAR_FOLDS:
            raise ValueError(f"{r.result_field}: a basic result must fold as a scalar, not {fold!r}")
        order = [f.name for f in message.fields]
        casts = {f.name: float if f.type == FieldDescriptor.TYPE_DOUBLE else uint64 for f in message.fields}
        steps.append((r.numbers, a, b, counts, fold,
                      tuple((name, order.index(attr), casts[attr]) for name, attr in pairs)))
    return kinds, tuple(steps)


def _frozen_snapshot(values: tuple[Any, ...]) -> LayerSnapshot:
    """``LayerSnapshot(*values)`` without the frozen ``__init__``'s one ``object.__setattr__`` per field.

    A scrape with every layer updated builds one per layer; this is ~2.5×
    cheaper and gives the same (still frozen) object.
    """
    snap = object.__new__(LayerSnapshot)
    # strict: a field added to LayerSnapshot but not to the caller's tuple must fail, not go missing.
    snap.__dict__.update(zip(_SNAPSHOT_FIELDS, values, strict=True))
    return snap


@dataclass
class _LayerState:
    #: Every LayerSnapshot field but the key (None: no series). Values are
    #: replaced on write, never mutated, so snapshots may share them.
    values: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(_SNAPSHOT_FIELDS[len(_KEY_FIELDS):]))
    #: (pass index, sum of squared L2 norms) of the first call's tensors in that pass.
    l2_pass: tuple[int, float] | None = None


class SnapshotStore:
    """Thread-safe latest-value store between the tap pipeline and the scrape.

    Writers (the host-transfer thread) call :meth:`update_from_summary` and
    :meth:`set_drift`; the scrape calls :meth:`snapshot`. Gauges keep the
    latest value; non-finite counts and histogram counts accumulate, because
    they are exported as counters.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._layers: dict[_Key, _LayerState] = {}
        self._clock = clock
        # The latest copy of each layer, and the layers written since (ordered
        # like _layers, so the snapshot order is the order layers appeared).
        self._snaps: dict[_Key, LayerSnapshot] = {}
        self._dirty: dict[_Key, None] = {}
        # Removed taps (oldest first, bounded): a summary still in flight must
        # not resurrect their series.
        self._gone: dict[str, None] = {}
        self._keys: dict[tuple[str, str, int, int], _Key] = {}

    def update_from_summary(self, tap_id: str, summary: Any) -> None:
        """Fold one ``layertap.v1.Summary`` into the store.

        Only ``output_index`` 0 of a module's first call in the pass feeds
        the gauges (labels have neither); non-finite counts of every output
        and call add up, so a NaN anywhere in the layer still raises the alert.
        """
        with self._lock:
            self._fold(tap_id, summary)

    def update_from_summaries(self, items: Iterable[tuple[str, Any]]) -> None:
        """:meth:`update_from_summary` of each ``(tap_id, summary)`` of one pass, under one lock:
        a scrape never sees part of a pass (a layer's L2 norm adds up its tensors)."""
        with self._lock:
            for tap_id, summary in items:
                self._fold(tap_id, summary)

    def update_from_basic(self, ts: float, pass_index: int, phase: int,
                          items: Iterable[tuple[str, str, int, int, int, bool, Layout, Sequence[float],
                                                Sequence[int]]]) -> None:
        """Fold one pass's basic-only results from their statistics slots, as if each were its summary.

        Why: a durable tap that only feeds ``/metrics`` needs no ``Summary``
        message; building and parsing one per layer per pass was most of the
        host-transfer thread's Python, which shares the GIL with the model.
        Each item is ``(tap, layer, point, output_index, call_index, sampled,
        layout, slots, shape)`` of one piece of a pass whose wall time is
        ``ts`` (a ``Timestamp``'s seconds); the store ends up exactly as
        :meth:`update_from_summaries` of the same summaries leaves it (a test
        compares them), but for the order of layers first seen in one pass:
        the publisher folds a pass's summaries before its basic pieces, two
        calls, so a scrape between them may see one tap at this pass and
        another at the last (a layer's own series are never split: each
        layer's pieces take one path). Every value is decoded before the lock
        is taken: a count out of range raises, as writing the summary would,
        and folds nothing of the pass.
        """
        decoded = []
        for tap, layer, point, output_index, call_index, sampled, layout, slots, shape in items:
            kinds, plan = _basic_plan(layout)
            first_call = call_index == 0
            primary = first_call and output_index == 0
            named = []
            for fn, a, b, counts, fold, pairs in plan:
                numbers = fn(slots[a:b], shape)
                for j in counts:  # every count a summary would carry, exported or not, is checked as writing it is
                    uint64(numbers[j])
                if pairs and (fold == "total" or (primary if fold == "latest" else first_call and sampled)):
                    named.append((fold, [(name, cast(numbers[j])) for name, j, cast in pairs]))
            decoded.append(((tap, layer, point, phase), first_call, sampled, primary, kinds, named))
        with self._lock:
            for raw, first_call, sampled, primary, kinds, named in decoded:
                st = self._begin(raw, ts, first_call, sampled, primary, kinds)
                if st is not None:
                    for fold, values in named:
                        self._fold_scalars(st, fold, values, first_call, sampled, primary, pass_index)

    def _begin(self, raw: tuple[str, str, int, int], ts: float, first_call: bool, sampled: bool, primary: bool,
               kinds: tuple[str | None, ...]) -> _LayerState | None:
        """A summary's layer state, its write noted; None for a removed tap. The caller holds the lock."""
        key = self._keys.get(raw)
        if key is None:
            if len(self._keys) >= _MAX_KEYS:
                self._keys.clear()
            key = self._keys[raw] = (raw[0], raw[1], point_name(raw[2]), phase_name(raw[3]))
        if key[0] in self._gone:
            return None
        st = self._layers.get(key)
        if st is None:
            st = self._layers[key] = _LayerState()
        self._dirty[key] = None
        v = st.values
        last = v["last_update"]
        v["last_update"] = ts if last is None or ts > last else last
        if primary and sampled:
            # A sampled summary carries everything the tap computes now; a
            # result it no longer carries (reducers changed, e.g. when a
            # baseline froze) must not linger as a stale series.
            for names, l2 in _fold_plan(kinds)[0]:
                for name in names:
                    v[name] = None
                if l2:
                    st.l2_pass = None
        return st

    @staticmethod
    def _fold_scalars(st: _LayerState, fold: str, values: Sequence[tuple[str, Any]], first_call: bool,
                      sampled: bool, primary: bool, pass_index: int) -> None:
        """One result's scalar fields into the layer's state (how each fold works: ``layertap._results``)."""
        v = st.values
        if fold == "total":
            # Every output and call adds up: a NaN anywhere in the layer still raises the alert.
            for name, value in values:
                v[name] = (v[name] or 0) + value
        elif fold == "pass_l2":
            if first_call and sampled:
                # Every tensor of the module's first call adds up: a param_grad
                # tap's series is the module's whole gradient norm (its
                # parameters are the outputs), so sqrt(sum(l2^2)) over a
                # partition of the model is clip_grad_norm_'s total.
                ((name, value),) = values
                sq = float(value) ** 2
                prev = st.l2_pass[1] if st.l2_pass is not None and st.l2_pass[0] == pass_index else 0.0
                st.l2_pass = (pass_index, prev + sq)
                v[name] = math.sqrt(st.l2_pass[1])
        elif primary and fold == "latest":
            for name, value in values:
                v[name] = float(value)

    def _fold(self, tap_id: str, summary: Any) -> None:
        """One summary into its layer's state (the caller holds the lock).

        Runs on the host-transfer thread for every durable summary of every
        pass, so what a summary's shape decides (its key's labels, which
        results it carries and how each folds) is looked up, not recomputed.
        """
        wall = summary.wall_time
        ts = wall.seconds + wall.nanos * 1e-9 if summary.HasField("wall_time") else self._clock()
        first_call = summary.call_index == 0
        sampled = not summary.unsampled
        primary = summary.output_index == 0 and first_call
        results = summary.results
        kinds = tuple([res.WhichOneof("value") for res in results])
        st = self._begin((tap_id or summary.tap, summary.layer, summary.point, summary.phase), ts, first_call,
                         sampled, primary, kinds)
        if st is None:
            return
        v = st.values
        histogram_seen = False
        for i, kind, fold, pairs in _fold_plan(kinds)[1]:
            msg = getattr(results[i], kind)
            if fold in _SCALAR_FOLDS:
                self._fold_scalars(st, fold, [(name, getattr(msg, attr)) for name, attr in pairs], first_call,
                                   sampled, primary, summary.pass_index)
            elif not primary:
                continue
            elif fold == "exported_quantiles":
                v[pairs[0][0]] = {float(p): float(x) for p, x in zip(msg.probabilities, msg.values)
                                  if round(float(p), 6) in EXPORTED_QUANTILES} or None
            elif fold == "cumulative_histogram":
                if histogram_seen:
                    # One counter per series: a second histogram (a baseline tap
                    # scoring several phases runs one per phase's edges) would
                    # restart it on every summary.
                    continue
                histogram_seen = True
                name = pairs[0][0]
                edges = tuple(msg.edges)
                counts = np.asarray(msg.counts, dtype=np.int64)
                if counts.shape[0] != len(edges) + 1:
                    continue  # malformed; never let one summary break the scrape
                old = v[name]
                # New edges (e.g. a baseline froze): a fresh counter. Otherwise a
                # new array: snapshots stay immutable.
                v[name] = (edges, counts) if old is None or old[0] != edges else (edges, old[1] + counts)

    def set_drift(
        self,
        tap: str,
        layer: str,
        point: str,
        score: DriftScore | None,
        thresholds: DriftThresholds | None = None,
        channel_fraction: float | None = None,
        *,
        phase: str = FORWARD,
    ) -> None:
        """Set a layer's drift scores (None while its baseline is collecting).

        Args:
            tap: Tap id (the baseline's tap).
            layer: Module name.
            point: Point label value (``"output"``...).
            score: Current scores, or None to export thresholds only.
            thresholds: Thresholds to export; default ``score.thresholds``.
            channel_fraction: Overrides ``score.channel_drift_fraction``.
            phase: Phase label value of the baseline (``"decode"``...): the
                scores join that phase's activation series.
        """
        key = (tap, layer, point, phase)
        with self._lock:
            if tap in self._gone:
                return
            st = self._layers.setdefault(key, _LayerState())
            self._dirty[key] = None
            v = st.values
            v["drift"], v["thresholds"], v["channel_drift_fraction"] = score, thresholds, channel_fraction

    def remove_tap(self, tap_id: str) -> None:
        """Forget every layer of a deleted or expired tap (its series vanish)."""
        with self._lock:
            self._gone[tap_id] = None
            while len(self._gone) > _MAX_TOMBSTONES:
                del self._gone[next(iter(self._gone))]
            for k in [k for k in self._layers if k[0] == tap_id]:
                del self._layers[k]
                self._snaps.pop(k, None)
                self._dirty.pop(k, None)

    def add_tap(self, tap_id: str) -> None:
        """A tap (possibly reusing a removed tap's name) may export again."""
        with self._lock:
            self._gone.pop(tap_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._layers)

    def snapshot(self) -> list[LayerSnapshot]:
        """An immutable copy of every layer's latest telemetry; a layer not written since the last call is the same object."""
        with self._lock:
            for key in self._dirty:
                # A layer's values are replaced on write, never mutated, so the copy may share them.
                self._snaps[key] = _frozen_snapshot((*key, *_state_values(self._layers[key].values)))
            self._dirty.clear()
            return list(self._snaps.values())
