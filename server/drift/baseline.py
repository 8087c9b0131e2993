"""The frozen reference of one (tap, layer, point, phase) that drift is scored against.

Built by :class:`~layertap.server.drift.builder.BaselineBuilder`, persisted by
:mod:`layertap.server.drift.files`. Its edges are the reference's own
quantiles, so the tap's histogram reducer runs on :attr:`Baseline.edges` once it
is frozen and the per-pass counts feed a
:class:`~layertap.server.drift.window.SlidingWindow`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from layertap.server.drift.merge import chan_merge
from layertap.server.drift.null import NullModel
from layertap.server.drift.phases import FORWARD
from layertap.server.drift.thresholds import DriftThresholds

__all__ = ["Baseline"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class Baseline:
    """A frozen reference for one (tap, layer, point, phase).

    Attributes:
        tap: Id of the durable tap that holds it (a label on the drift series).
        layer: Module name.
        point: Hook point in lower case (``"output"``, ``"input"``, ...).
        edges: Inner edges, strictly increasing (n).
        counts: int64 counts, n + 1, open end bins first and last.
        count: Elements the moments cover.
        mean: Mean over the reference.
        m2: Σ (x - mean)^2 over the reference (kept so merges are exact).
        min: Smallest value seen.
        max: Largest value seen.
        passes: Live passes in the reference.
        quantiles: ``{probability: value}`` of the reference.
        channel_mean: Per-channel means, or None when channels were not tapped.
        channel_std: Per-channel population stds, same length.
        window: Sliding-window length (passes) drift uses against it.
        thresholds: Drift thresholds for this layer.
        created_at: Unix time the baseline was frozen.
        phase: The passes it was frozen from (``"forward"``, ``"prefill"``,
            ``"decode"``): only passes of that phase are scored against it.
        null: The no-change statistics of its calibrated alarm (None: read from a file older than calibration).
        fixed: The thresholds were given: they decide the alarm, not calibration.
        derive: What its tap reads of the tensor (a ``pb.Derive`` value, named in its document by
            ``reducers.derive.DERIVE_NAMES``; 0: the tensor itself). A derived baseline has no
            per-feature statistics.
    """

    tap: str
    layer: str
    point: str
    edges: FloatArray
    counts: npt.NDArray[np.int64]
    count: int
    mean: float
    m2: float
    min: float
    max: float
    passes: int
    quantiles: dict[float, float] = field(default_factory=dict)
    channel_mean: FloatArray | None = None
    channel_std: FloatArray | None = None
    window: int = 50
    thresholds: DriftThresholds = field(default_factory=DriftThresholds)
    created_at: float = 0.0
    phase: str = FORWARD
    null: NullModel | None = None
    fixed: bool = False
    derive: int = 0

    @property
    def key(self) -> tuple[str, str, str, str]:
        """``(tap, layer, point, phase)``, the identity of a baseline."""
        return (self.tap, self.layer, self.point, self.phase)

    @property
    def std(self) -> float:
        """Population std (ddof=0)."""
        return math.sqrt(max(self.m2, 0.0) / self.count) if self.count > 0 else math.nan

    @property
    def proportions(self) -> FloatArray:
        """Counts normalised to sum to 1."""
        total = int(self.counts.sum())
        return self.counts / total if total > 0 else np.zeros(self.counts.shape, dtype=np.float64)

    def merge(self, other: Baseline) -> Baseline:
        """Merge a baseline of the same layer built elsewhere on the same edges.

        Counts add and moments merge exactly (Chan). Quantiles cannot merge
        exactly from their values alone; they become the count-weighted mean
        of both sides, a fair approximation when both references come from
        the same distribution (the replica case). Window, thresholds and tap
        are kept from ``self``; the null statistics do not merge, so the
        result is uncalibrated.

        Raises:
            ValueError: On a different layer/point/phase/derive or different edges.
        """
        if (self.layer, self.point, self.phase) != (other.layer, other.point, other.phase):
            raise ValueError(f"cannot merge baselines of {self.layer}/{self.point}/{self.phase} and "
                             f"{other.layer}/{other.point}/{other.phase}")
        if self.derive != other.derive:
            raise ValueError(f"cannot merge baselines of {self.layer} that read different quantities "
                             f"(derive {self.derive} and {other.derive})")
        if self.edges.shape != other.edges.shape or not np.array_equal(self.edges, other.edges):
            raise ValueError(f"cannot merge baselines of {self.layer} with different edges; rebuild one on the other's edges")
        n, mean, m2 = chan_merge(self.count, self.mean, self.m2, other.count, other.mean, other.m2)
        quantiles = {}
        for p in sorted(set(self.quantiles) & set(other.quantiles)):
            quantiles[p] = (self.quantiles[p] * self.count + other.quantiles[p] * other.count) / n if n else self.quantiles[p]
        cmean, cstd = self.channel_mean, self.channel_std
        if (
            cmean is not None and cstd is not None and other.channel_mean is not None
            and other.channel_std is not None and cmean.shape == other.channel_mean.shape
        ):
            c = cmean.shape[0]
            na, nb = self.count / c, other.count / c
            _, cm, cm2 = chan_merge(na, cmean, cstd**2 * na, nb, other.channel_mean, other.channel_std**2 * nb)
            cmean, cstd = np.asarray(cm, dtype=np.float64), np.sqrt(np.asarray(cm2, dtype=np.float64) / (na + nb))
        else:
            cmean = cstd = None
        return replace(
            self,
            counts=self.counts + other.counts,
            count=int(n),
            mean=float(mean),
            m2=float(m2),
            min=min(self.min, other.min),
            max=max(self.max, other.max),
            passes=self.passes + other.passes,
            quantiles=quantiles,
            channel_mean=cmean,
            channel_std=cstd,
            null=NullModel.uncalibrated("merged from frozen baselines, whose null statistics do not merge",
                                        self.window),
        )
