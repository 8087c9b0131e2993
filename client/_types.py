"""Public types of the layertap client: small frozen dataclasses and type aliases.

None of them holds a protobuf object; :mod:`layertap._convert` builds them. The
reducer results (``Moments``...) are in :mod:`layertap._results`, with the
table of result kinds.

Point names are ``"output"``, ``"input"``, ``"grad_output"``, ``"grad_input"``
and ``"param_grad"``; dtype names are numpy-style (``"float32"``,
``"bfloat16"``, ...).
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, Union

import numpy.typing as npt

from ._results import *  # noqa: F403 - the result dataclasses lived here before layertap 0.3: old pickles still load
from ._results import RESULTS, ReducerResult

__all__ = [
    "BaselineInfo",
    "DriftThresholds",
    "LayerDrift",
    "LayerInfo",
    "ModelMetadata",
    "ReducerSpec",
    "ServerStats",
    "Structured",
    "Summary",
    "TapEvent",
    "TapInfo",
    "TapSpec",
    "TensorSpec",
    "Triggers",
]

Shape = tuple[int, ...]

#: A reducer as the client accepts it: a name such as ``"moments"``, or a
#: one-key mapping of name to parameters such as ``{"histogram": {"bins": 32}}``.
ReducerSpec: TypeAlias = Union[str, Mapping[str, Mapping[str, Any]]]
#: Reducers of a tap or watch that names none: cheap, and enough for the CLI table.
DEFAULT_REDUCERS: tuple[str, ...] = tuple(r.field for r in RESULTS if r.default)

#: A value that ``Client.capture`` (and ``Client.infer``) returns per layer: a
#: numpy array; or, for a tuple/list output (or a multi-argument input) a list
#: ordered by position, for a dict output a dict, and for a module that runs
#: more than once per pass a list with one such value per call.
Structured: TypeAlias = Union[npt.NDArray[Any], list["Structured"], dict[str, "Structured"]]


@dataclass(frozen=True)
class TensorSpec:
    """A declared model input: ``forward``'s argument name; ``-1`` marks a free dimension (batch, sequence)."""

    name: str
    dtype: str
    shape: Shape
    #: The model runs without it (an ``attention_mask`` it defaults).
    optional: bool = False


@dataclass(frozen=True)
class ModelMetadata:
    """What the server hosts, and how to build a valid input for it.

    ``rank`` and ``world_size`` are a training agent's (``layertap.attach``)
    ``torch.distributed`` place; None on a serving replica.
    """

    model_name: str
    source: str
    device: str
    dtype: str
    parameter_count: int
    inputs: list[TensorSpec]
    server_version: str
    api_version: str
    active_hooks: int
    hooks_supported: bool
    rank: int | None = None
    world_size: int | None = None


@dataclass(frozen=True)
class LayerInfo:
    """One module of the served model, with the shapes last seen at it."""

    name: str
    type: str
    parameter_count: int
    input_shapes: list[Shape]
    output_shapes: list[Shape]


@dataclass(frozen=True)
class ServerStats:
    """Server-wide counters; ``active_hooks`` returns to its idle value when nothing leaks."""

    active_hooks: int
    passes: int
    active_captures: int
    subscribers: int
    taps: int
    reducer_errors: int
    stream_dropped: int
    #: ``serve --compile-model`` only (0 otherwise): Infer passes run by a compiled
    #: graph and by the eager module; model compiles finished and failed; compiles
    #: seen on a request's thread (should stay 0); compiled variants live.
    compiled_passes: int = 0
    eager_passes: int = 0
    model_compiles: int = 0
    model_compile_failures: int = 0
    request_thread_compiles: int = 0
    compiled_variants: int = 0


@dataclass(frozen=True)
class Triggers:
    """When a durable tap records an incident (the server's flight recorder).

    The server needs ``--incident-dir`` (and ``--record-inputs`` to keep and
    replay the input); each trigger reads a reducer the tap must have.

    Attributes:
        nonfinite: Fire when the ``nonfinite`` reducer counts any NaN or Inf.
        abs_max_above: Fire when ``abs_max`` exceeds this (None: off).
        mean_sigma: Fire when the ``moments`` mean is this many baseline
            standard deviations from the baseline mean (None: off; the layer
            needs a baseline).
        min_interval: At most one incident per trigger per this many seconds
            (None: the server's 60).
    """

    nonfinite: bool = False
    abs_max_above: float | None = None
    mean_sigma: float | None = None
    min_interval: float | None = None


@dataclass(frozen=True)
class TapSpec:
    """What a tap hooks, how it summarizes and how often.

    Attributes:
        selector: Exact module name, glob (``*`` stays within a dot level,
            ``**`` crosses) or ``re:``-prefixed regex.
        reducers: Reducer names, or one-key mappings name -> parameters.
        point: Where on the module the tensor is read.
        every: Run reducers on every N-th live pass (None: every pass).
        probability: Run reducers on a pass with this probability (None: always).
        max_per_second: At most this many summaries per second (None: unlimited).
        name: A label for the tap.
        triggers: Flight-recorder triggers of a durable tap (None: none).
        phases: Only passes of these phases feed the tap: ``"prefill"``,
            ``"decode"`` (a generation's passes, ``Client.generate``) and
            ``""`` (a plain forward: Infer, a capture, a training step).
            Empty: every pass.
        keep_padding: Keep padded positions in the statistics. By default,
            for a model that takes an ``attention_mask``, the positions a
            pass's mask marks as padding are left out of every reducer (and
            so of baselines and drift) for tensors whose leading dims are
            ``(batch, tokens)``; a ``per_channel`` dim then may not be 0 or 1.
        derive: Reduce a quantity derived from the tensor instead of the
            tensor: ``"entropy"`` (softmax entropy over the last axis, in
            nats) or ``"top1_prob"`` (the largest softmax probability), one
            value per row, so a ``(batch, tokens, vocab)`` logits tensor is
            reduced as ``(batch, tokens)``. ``""``: the tensor itself.
    """

    selector: str
    reducers: tuple[ReducerSpec, ...] = DEFAULT_REDUCERS
    point: str = "output"
    every: int | None = None
    probability: float | None = None
    max_per_second: float | None = None
    name: str = ""
    triggers: Triggers | None = None
    phases: tuple[str, ...] = ()
    keep_padding: bool = False
    derive: str = ""


@dataclass(frozen=True)
class TapInfo:
    """A tap as the server reports it, with its counters.

    ``kind`` is ``"durable"`` or ``"stream"``; ``expires_at`` is None for taps
    that never expire. Times are timezone-aware UTC datetimes. ``owner`` is
    the token id that created the tap (``"anonymous"`` without auth, ``""``
    for taps the server owns); deleting another owner's tap needs ``admin``.
    """

    id: str
    spec: TapSpec
    kind: str
    layers: list[str]
    hits: int
    drops: int
    errors: int
    last_error: str
    disabled: bool
    expires_at: _dt.datetime | None
    created_at: _dt.datetime | None
    owner: str = ""
    #: How its passes are served: ``"eager"`` (Python hooks on the eager module),
    #: and on a compiled server ``"in_graph"`` (statistics inside the compiled
    #: graph), ``"compiling_eager"`` (its graph compiles; the eager module serves
    #: its passes meanwhile), ``"pending"`` (its graph compiles; it sees no pass
    #: yet) or ``"compile_failed"`` (the previous graph serves; it sees no pass).
    serving: str = ""
    #: The server's overhead budget (``serve --tap-budget``) has the tap sample
    #: 1 in ``throttle`` of the passes its own sampling picks (1: all), and why.
    throttle: int = 1
    throttle_reason: str = ""


@dataclass(frozen=True)
class Summary:
    """The reducer results of one tap on one tensor of one pass.

    Attributes:
        results: Reducer name -> result, e.g. ``results["moments"].mean``.
        step: The training step, when the host reports one.
        wall_time: Seconds since the epoch when the pass ran.
        unsampled: True when only the always-on ``nonfinite`` reducer ran.
        call_index: 0 for the module's first call in the pass, 1 for a second...
        rank: The ``torch.distributed`` rank of the training agent that sent
            it; None from a serving replica.
        output_key: For a tensor the module got as a keyword argument (point
            ``input``), the keyword or its path in one
            (``position_embeddings.0``); "" for positional arguments and
            outputs. ``output_index`` counts positional tensors first.
        phase: The pass's place in a generation: ``"prefill"`` or
            ``"decode"``; ``""`` for a plain forward (Infer, a capture).
        position: The position, in its sequence, of the token the pass
            produces (the prompt's length for a prefill); None for a plain
            forward, or a pass whose rows produce different positions.
        request_ids: The generations (``Generation.request_id``) whose rows
            the pass holds. A durable tap summarizes the whole batch; a
            generation's own taps only its rows.
        throttle: The server's overhead budget thinned the tap to 1 in this
            many of the passes its own sampling picks (1: not thinned); see
            ``TapInfo.throttle_reason``.
    """

    tap: str
    layer: str
    point: str
    output_index: int
    pass_index: int
    step: int | None
    wall_time: float
    unsampled: bool
    results: dict[str, ReducerResult] = field(default_factory=dict)
    call_index: int = 0
    rank: int | None = None
    output_key: str = ""
    phase: str = ""
    position: int | None = None
    request_ids: tuple[str, ...] = ()
    throttle: int = 1


@dataclass(frozen=True)
class TapEvent:
    """Something that happened to a tap, e.g. kind ``"disabled"`` after a reducer error."""

    tap: str
    kind: str
    message: str


@dataclass(frozen=True)
class BaselineInfo:
    """The durable tap collecting a drift baseline, and the layers it covers."""

    tap: str
    layers: list[str]


@dataclass(frozen=True)
class DriftThresholds:
    """Thresholds above which a drift score counts as drift (defaults as the server's)."""

    psi: float = 0.2
    js: float = 0.1
    wasserstein: float = 0.1
    mean_shift: float = 1.0


@dataclass(frozen=True)
class LayerDrift:
    """Current drift of one layer against its baseline.

    ``state`` is ``"collecting"``, ``"ready"``, or ``"unsaved"``: frozen and
    scoring, but its file could not be written (``save_error`` says why), so
    it would be lost at a restart until the server's retries write it.
    ``channel_drift_fraction`` is None when per-channel stats are not tapped.
    ``phase`` is the generation phase whose passes it scores (``"prefill"``,
    ``"decode"``, or ``""`` for plain forwards): a layer has one entry per phase seen.
    ``derive`` is what the baseline reads of the tensor (``"entropy"``,
    ``"top1_prob"``; ``""``: the tensor itself).

    The alarm (``drifted`` and ``alarm`` agree): ``calibration`` is
    ``"calibrated"`` (thresholds from the baseline's own null model at the
    server's false-alarm rate), ``"uncalibrated"`` (never fires;
    ``calibration_reason`` says why, e.g. a baseline too short) or ``"fixed"``
    (explicit thresholds: any of the four scores over its threshold).
    ``score`` is the last completed window's largest per-feature |z|,
    ``threshold`` its threshold, ``ratio`` the two's quotient (NaN before the
    first window); ``detection_passes`` counts the passes from the change's
    estimated start to the pass that raised the alarm (0 while none).
    """

    tap: str
    layer: str
    point: str
    state: str
    baseline_passes: int
    window_passes: int
    psi: float
    js: float
    wasserstein: float
    mean_shift: float
    thresholds: DriftThresholds
    drifted: bool
    channel_drift_fraction: float | None
    save_error: str = ""
    phase: str = ""
    derive: str = ""
    calibration: str = ""
    calibration_reason: str = ""
    score: float = math.nan
    threshold: float = math.nan
    p_value: float = math.nan
    alarm: bool = False
    detection_passes: int = 0
    alarm_pass: int = 0
    scored_passes: int = 0
    windows: int = 0
    ignored_passes: int = 0
    constant_features: int = 0
    false_alarm_rate: float = 0.0

    @property
    def ratio(self) -> float:
        """``score / threshold`` (NaN before the first window, or when not calibrated)."""
        return self.score / self.threshold if self.threshold > 0 else math.nan
