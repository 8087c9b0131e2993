"""Baselines built incrementally from live passes, then frozen.

Why two phases. A baseline histogram has its inner edges at the reference's
own quantiles, which are unknown until the reference is complete. So:

1. **Collect** (:class:`BaselineBuilder`). Per pass the tap engine feeds a
   bounded float64 sample of the tensor (the sample its ``quantiles`` or
   ``histogram`` reducer already draws), the pass's moments and its min/max.
   The builder keeps

   - moments merged with Chan's parallel formula in float64 (exact to rounding),
   - the observed min and max,
   - a *weighted* reservoir of at most ``reservoir_size`` values (A-Res,
     Efraimidis & Spirakis 2006). Each sampled element weighs
     ``population / sample_size``, so a pass with a bigger batch counts more, as
     it would in the real distribution. A-Res gives every element a key
     ``u^(1/w)`` once and keeps the largest keys, so two reservoirs merge
     exactly by keeping the largest keys of their union: merging builders from
     replicas is the same as one builder having seen all passes.

   Memory is bounded by the reservoir, whatever N is.
2. **Freeze** (:meth:`BaselineBuilder.freeze`). Edges = reservoir quantiles at
   ``linspace(0.05, 0.95, bins - 1)``, deduplicated so they strictly increase
   (a ReLU's many zeros collapse several quantiles into one edge). The
   baseline counts are the reservoir binned on those edges with the reducer's
   convention (bins are ``[e_i, e_{i+1})``, open ends). From then on the tap's
   histogram reducer runs on :attr:`Baseline.edges` and its per-pass counts
   feed a :class:`~layertap.server.drift.window.SlidingWindow`.
"""

from __future__ import annotations

import builtins  # `feed` shadows min/max with the reducer's field names
import math
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.merge import chan_merge
from layertap.server.drift.null import NullAccumulator
from layertap.server.drift.phases import FORWARD
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.reducers.spec import DEFAULT_PROBABILITIES

__all__ = ["BaselineBuilder", "BuilderState"]

FloatArray = npt.NDArray[np.float64]


def _bin(values: FloatArray, edges: FloatArray) -> npt.NDArray[np.int64]:
    """Counts on ``edges`` with the reducer's convention: ``[e_i, e_{i+1})``, open ends."""
    idx = np.searchsorted(edges, values, side="right")
    return np.bincount(idx, minlength=edges.shape[0] + 1).astype(np.int64)


@dataclass(frozen=True)
class BuilderState:
    """Everything a builder holds, so that another replica can merge it exactly.

    ``keys`` are the log A-Res keys of ``values``; ``channel_*`` are None when
    channels were not tapped; ``phase`` names the passes it collected.
    """

    layer: str
    point: str
    target_passes: int
    passes: int
    skipped_passes: int
    count: int
    mean: float
    m2: float
    min: float
    max: float
    values: FloatArray
    keys: FloatArray
    channel_count: float = 0.0
    channel_mean: FloatArray | None = None
    channel_m2: FloatArray | None = None
    phase: str = FORWARD


class BaselineBuilder:
    """Collects a baseline for one (tap, layer, point, phase), one live pass at a time.

    See the module docstring for why it keeps a weighted reservoir. Not
    thread-safe: the host-transfer thread owns it.
    """

    def __init__(
        self,
        tap: str,
        layer: str,
        point: str = "output",
        *,
        passes: int = 100,
        reservoir_size: int = 20_000,
        seed: int | None = None,
        phase: str = FORWARD,
        window: int = 50,
    ) -> None:
        """Start collecting.

        Args:
            tap: Tap id.
            layer: Module name.
            point: Hook point, lower case.
            passes: Passes wanted; :attr:`done` turns true after that many.
            reservoir_size: Values kept for the quantile edges.
            seed: Seed of the reservoir's random keys (None: fresh entropy).
            phase: The phase whose passes the caller feeds (``"decode"``...).
            window: The drift window, the size of the held-out windows of the null model.
        """
        if reservoir_size < 1:
            raise ValueError("reservoir_size must be >= 1")
        self.tap, self.layer, self.point, self.phase = tap, layer, point, phase
        self.target_passes = int(passes)
        self.reservoir_size = int(reservoir_size)
        self._rng = np.random.default_rng(seed)
        self._values = np.empty(0, dtype=np.float64)
        self._keys = np.empty(0, dtype=np.float64)  # log of the A-Res key
        self.passes = 0
        #: Passes refused (no finite element, or non-finite moments): they
        #: never enter the reference, and a stream of them stalls collection.
        self.skipped_passes = 0
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf
        self._c_n = 0.0
        self._c_mean: FloatArray | None = None
        self._c_m2: FloatArray | None = None
        #: The null statistics of the calibrated alarm (``null.components`` of each pass).
        self.null = NullAccumulator(window)

    @property
    def done(self) -> bool:
        """True once the requested number of passes has been fed."""
        return self.passes >= self.target_passes

    def skip(self) -> None:
        """Count a pass the caller refused before feeding it (same meaning as feed's own refusals)."""
        self.skipped_passes += 1

    def feed(
        self,
        sample: npt.ArrayLike,
        count: int,
        mean: float,
        std: float,
        min: float,  # noqa: A002 - mirrors the reducer field names
        max: float,  # noqa: A002
        *,
        population: int | None = None,
        channel_mean: npt.ArrayLike | None = None,
        channel_std: npt.ArrayLike | None = None,
        components: npt.ArrayLike | None = None,
    ) -> None:
        """Add one live pass.

        Args:
            sample: Up to S values of the tensor drawn uniformly (any float
                dtype; non-finite values are dropped).
            count: Elements the moments cover (the tensor's numel).
            mean: Mean of the pass.
            std: Population std of the pass (ddof=0).
            min: Smallest value of the pass.
            max: Largest value of the pass.
            population: Elements the sample was drawn from (default ``count``).
            channel_mean: Per-channel means, if tapped.
            channel_std: Per-channel population stds, if tapped.
            components: The pass's components for the null model (:func:`.null.components`).
        """
        if count <= 0 or not (math.isfinite(mean) and math.isfinite(std)):
            # A pass with NaN/Inf must not poison the reference; the nonfinite
            # alert covers it.
            self.skip()
            return
        self.passes += 1
        if components is not None:
            self.null.add(components, weight=float(count))
        n, m, m2 = chan_merge(self.count, self.mean, self.m2, int(count), float(mean), float(std) ** 2 * count)
        self.count, self.mean, self.m2 = int(n), float(m), float(m2)
        if math.isfinite(min):
            self.min = builtins.min(self.min, float(min))
        if math.isfinite(max):
            self.max = builtins.max(self.max, float(max))
        s = np.asarray(sample, dtype=np.float64).ravel()
        s = s[np.isfinite(s)]
        if s.size:
            w = float(population if population is not None else count) / s.size
            keys = np.log(self._rng.random(s.size)) / w
            self._keep(np.concatenate((self._values, s)), np.concatenate((self._keys, keys)))
        if channel_mean is not None and channel_std is not None:
            cm = np.asarray(channel_mean, dtype=np.float64)
            cs = np.asarray(channel_std, dtype=np.float64)
            if cm.shape == cs.shape and cm.ndim == 1 and cm.size and (self._c_mean is None or self._c_mean.shape == cm.shape):
                nb = count / cm.size
                if self._c_mean is None or self._c_m2 is None:
                    self._c_n, self._c_mean, self._c_m2 = nb, cm.copy(), cs**2 * nb
                else:
                    c_n, c_m, c_m2 = chan_merge(self._c_n, self._c_mean, self._c_m2, nb, cm, cs**2 * nb)
                    self._c_n, self._c_mean, self._c_m2 = float(c_n), c_m, c_m2

    def _keep(self, values: FloatArray, keys: FloatArray) -> None:
        if values.size > self.reservoir_size:
            top = np.argpartition(keys, values.size - self.reservoir_size)[values.size - self.reservoir_size :]
            values, keys = values[top], keys[top]
        self._values, self._keys = values, keys

    def merge(self, other: BaselineBuilder) -> None:
        """Fold ``other`` (same layer, point and phase, e.g. another replica) into this one."""
        if (self.layer, self.point, self.phase) != (other.layer, other.point, other.phase):
            raise ValueError(f"cannot merge builders of {self.layer}/{self.point}/{self.phase} and "
                             f"{other.layer}/{other.point}/{other.phase}")
        n, m, m2 = chan_merge(self.count, self.mean, self.m2, other.count, other.mean, other.m2)
        self.count, self.mean, self.m2 = int(n), float(m), float(m2)
        self.passes += other.passes
        self.skipped_passes += other.skipped_passes
        self.null.merge(other.null)
        self.min = builtins.min(self.min, other.min)
        self.max = builtins.max(self.max, other.max)
        self._keep(np.concatenate((self._values, other._values)), np.concatenate((self._keys, other._keys)))
        if other._c_mean is not None and other._c_m2 is not None:
            if self._c_mean is None or self._c_m2 is None:
                self._c_n, self._c_mean, self._c_m2 = other._c_n, other._c_mean.copy(), other._c_m2.copy()
            elif self._c_mean.shape == other._c_mean.shape:
                n, cm, cm2 = chan_merge(self._c_n, self._c_mean, self._c_m2, other._c_n, other._c_mean, other._c_m2)
                self._c_n, self._c_mean, self._c_m2 = float(n), np.asarray(cm), np.asarray(cm2)

    def state(self) -> BuilderState:
        """A copy of everything this builder holds (see :meth:`from_state`)."""
        return BuilderState(
            self.layer, self.point, self.target_passes, self.passes, self.skipped_passes, self.count,
            self.mean, self.m2, self.min, self.max, self._values.copy(), self._keys.copy(), self._c_n,
            None if self._c_mean is None else self._c_mean.copy(), None if self._c_m2 is None else self._c_m2.copy(),
            self.phase,
        )

    @classmethod
    def from_state(cls, tap: str, state: BuilderState, *, reservoir_size: int = 20_000) -> BaselineBuilder:
        """A builder holding ``state`` (exported by another replica), ready to merge or freeze.

        ``state`` must already be valid (``exchange.builder_state_from_proto`` checks it).
        """
        b = cls(tap, state.layer, state.point, passes=state.target_passes, reservoir_size=reservoir_size,
                phase=state.phase)
        b.passes, b.skipped_passes, b.count = state.passes, state.skipped_passes, state.count
        b.mean, b.m2, b.min, b.max = state.mean, state.m2, state.min, state.max
        b._keep(np.asarray(state.values, dtype=np.float64), np.asarray(state.keys, dtype=np.float64))
        if state.channel_mean is not None and state.channel_m2 is not None:
            b._c_n, b._c_mean, b._c_m2 = state.channel_count, state.channel_mean.copy(), state.channel_m2.copy()
        return b

    @property
    def reservoir(self) -> FloatArray:
        """The values currently kept (a copy, unordered)."""
        return self._values.copy()

    def freeze(
        self,
        *,
        bins: int = 20,
        edge_range: tuple[float, float] = (0.05, 0.95),
        probabilities: tuple[float, ...] = DEFAULT_PROBABILITIES,
        window: int = 50,
        thresholds: DriftThresholds | None = None,
        fixed: bool = False,
        derive: int = 0,
    ) -> Baseline:
        """Freeze the reference: place edges at its quantiles and bin the reservoir.

        Args:
            bins: Bins including the two open end bins (``bins - 1`` inner edges).
            edge_range: Probabilities of the first and last inner edge.
            probabilities: Quantiles to store.
            window: Sliding window drift will use.
            thresholds: Drift thresholds (defaults when None).
            fixed: The thresholds were given: they decide the alarm, not calibration.
            derive: What the tap fed it in place of the tensor (``pb.Derive``; 0: the tensor), kept
                on the baseline so that its file reloads it as what it is.

        Raises:
            ValueError: When no usable pass or value was fed.
        """
        if self.count <= 0 or self._values.size == 0:
            raise ValueError(f"baseline for {self.layer} has no data yet ({self.passes} passes fed)")
        if bins < 2:
            raise ValueError("bins must be >= 2")
        v = self._values
        edges = np.unique(np.quantile(v, np.linspace(edge_range[0], edge_range[1], bins - 1)))
        q = np.quantile(v, np.asarray(probabilities, dtype=np.float64)) if probabilities else np.empty(0)
        c_std = None
        if self._c_mean is not None and self._c_m2 is not None and self._c_n > 0:
            c_std = np.sqrt(np.maximum(self._c_m2, 0.0) / self._c_n)
        return Baseline(
            tap=self.tap,
            layer=self.layer,
            point=self.point,
            edges=edges.astype(np.float64),
            counts=_bin(v, edges),
            count=self.count,
            mean=self.mean,
            m2=self.m2,
            min=self.min if math.isfinite(self.min) else float(v.min()),
            max=self.max if math.isfinite(self.max) else float(v.max()),
            passes=self.passes,
            quantiles={float(p): float(x) for p, x in zip(probabilities, q)},
            channel_mean=None if self._c_mean is None else self._c_mean.copy(),
            channel_std=c_std,
            window=int(window),
            thresholds=thresholds or DriftThresholds(),
            created_at=time.time(),
            phase=self.phase,
            null=self.null.freeze(),
            fixed=fixed,
            derive=derive,
        )
