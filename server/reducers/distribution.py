"""The distribution reducers: histogram, quantiles and per-channel statistics.

Unlike the basic reducers these do their own device work, on the workspace's
shared bounded sample (histogram, quantiles: one sort serves both) or on the
leading channels (per_channel). Their parameters arrive validated by
:mod:`layertap.server.reducers.spec`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from layertap.server.reducers.base import Reducer, shape_numel
from layertap.server.reducers.spec import QUANTILE_DELTA, SpecError, default_feature_axis
from layertap.server.reducers.workspace import F64, DeviceCache, Workspace, device_constant
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["HistogramReducer", "PerChannelReducer", "QuantilesReducer"]


class HistogramReducer(Reducer):
    """Counts over frozen edges, on the whole tensor or a uniform sample."""

    kind = pb.REDUCER_KIND_HISTOGRAM

    def __init__(self, field: str, edges: Sequence[float], sample_size: int,
                 bins: int = 0, lo: float = 0.0, hi: float = 0.0) -> None:
        super().__init__(field)
        self.edges = tuple(float(e) for e in edges)
        self.sample_size = sample_size
        self._range = (bins, lo, hi)  # echoed in spec() when given as a range
        self._edge_cache: DeviceCache = {}

    def spec(self) -> pb.ReducerSpec:
        bins, lo, hi = self._range
        params = (
            pb.HistogramParams(bins=bins, min=lo, max=hi, sample_size=self.sample_size)
            if bins
            else pb.HistogramParams(edges=self.edges, sample_size=self.sample_size)
        )
        return pb.ReducerSpec(kind=self.kind, histogram=params)

    def key(self) -> tuple[object, ...]:
        return (self.kind, self.edges, self.sample_size)

    def width(self, shape: Sequence[int]) -> int:
        return len(self.edges) + 1

    def compute(self, ws: Workspace) -> torch.Tensor:
        # Cumulative counts [< edges[0], ..., < edges[-1], all binned]; decode
        # takes the differences, which keeps device ops (and their Python
        # dispatch, ~4 us each on a small CPU) few on the model thread.
        x = ws.x
        if ws.numel == 0:
            return x.new_zeros((len(self.edges) + 1,), dtype=F64)
        edges = device_constant(self._edge_cache, self.edges, x.device)
        # Only a bounded sample is ever binned (full-tensor scatters are the
        # 39x trap measured in docs/design.md), and binned by binary-searching
        # the edges in the sorted sample: no atomics, deterministic, and the
        # sort is shared with quantiles.
        s, n = ws.sorted_sample(self.sample_size)
        below = torch.searchsorted(s, edges, right=False)  # elements < edge
        return torch.cat([below.to(F64), n.reshape(1)])  # NaN (mapped to +inf) is not binned

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        # One vectorized rint (half-to-even, like round()): round() on numpy
        # scalars costs ~1.5 us each, and decoding runs on the host-transfer thread
        # thread, which competes with the model thread for the GIL.
        counts = np.diff(np.rint(values), prepend=0.0).astype(np.int64).tolist()
        return pb.ReducerResult(
            histogram=pb.Histogram(
                edges=self.edges, counts=counts, sample_size=sum(counts), population=shape_numel(shape)
            )
        )


class QuantilesReducer(Reducer):
    """Quantiles of the non-NaN elements, exact or from a bounded sample."""

    kind = pb.REDUCER_KIND_QUANTILES

    def __init__(self, field: str, probabilities: Sequence[float], sample_size: int) -> None:
        super().__init__(field)
        self.probabilities = tuple(float(p) for p in probabilities)
        self.sample_size = sample_size
        self._p_cache: DeviceCache = {}
        self._p_host = np.array(self.probabilities, dtype=np.float64)

    def spec(self) -> pb.ReducerSpec:
        params = pb.QuantileParams(probabilities=self.probabilities, sample_size=self.sample_size)
        return pb.ReducerSpec(kind=self.kind, quantiles=params)

    def key(self) -> tuple[object, ...]:
        return (self.kind, self.probabilities, self.sample_size)

    def width(self, shape: Sequence[int]) -> int:
        # [non-NaN sample count, order statistics below each p..., above each p...]
        return 1 + 2 * len(self.probabilities)

    def compute(self, ws: Workspace) -> torch.Tensor:
        # The device only selects the two order statistics around each rank;
        # decode interpolates on the host, so the model thread pays ~10 small
        # ops per tensor instead of ~30.
        x = ws.x
        k = len(self.probabilities)
        if ws.numel == 0:
            return torch.cat([x.new_zeros((1,), dtype=F64), x.new_full((2 * k,), math.nan, dtype=F64)])
        s, n = ws.sorted_sample(self.sample_size)  # the non-NaN values occupy s[:n]
        p = device_constant(self._p_cache, self.probabilities, x.device)
        top = n - 1.0
        below = torch.floor(top * p)  # numpy 'linear' (Hyndman-Fan 7): virtual index (n - 1) p
        ranks = torch.cat([below, below + 1.0]).clamp_(max=top).clamp_(min=0.0)
        return torch.cat([n.reshape(1), s.index_select(0, ranks.long())])

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        population = shape_numel(shape)
        n = int(round(float(values[0])))
        k = len(self.probabilities)
        sampled = population > self.sample_size
        if not sampled:
            rank_error = 0.0
        elif n == 0:
            rank_error = 1.0  # nothing but NaN was drawn: no information
        else:
            rank_error = min(1.0, math.sqrt(math.log(2.0 / QUANTILE_DELTA) / (2.0 * n)) + 1.0 / n)
        return pb.ReducerResult(
            quantiles=pb.Quantiles(
                probabilities=self.probabilities,
                values=_interpolate(values[0], self._p_host, values[1 : 1 + k], values[1 + k :]).tolist(),
                sample_size=n,
                population=population,
                rank_error=rank_error,
            )
        )


def _interpolate(n: float, p: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """numpy's 'linear' quantiles from the order statistics around each rank.

    The same float64 operations as ``np.quantile``, so results match it bit for
    bit when unsampled. An infinite endpoint would make the lerp NaN
    (inf - inf); the nearer order statistic is used instead, which is within
    the same rank error. NaN for every p when there is no non-NaN value.
    """
    if n < 0.5:
        return np.full(len(p), math.nan)
    virtual = (n - 1.0) * p  # the device's virtual index, bit for bit
    gamma = virtual - np.floor(virtual)
    upper = gamma >= 0.5
    with np.errstate(invalid="ignore"):
        diff = b - a
        lerp = np.where(upper, b - diff * (1.0 - gamma), a + diff * gamma)
    value = np.where(np.isinf(a) | np.isinf(b), np.where(upper, b, a), lerp)
    return np.where(a == b, a, value)


class PerChannelReducer(Reducer):
    """Mean, std and abs_max of the finite elements of each channel.

    Args:
        dim: The channel axis (negative: from the end), or None for the
            model's feature axis (:func:`~.spec.default_feature_axis`).
        tokens: Whether the model is a token model, for the default axis.

    The :meth:`folded` reducer reads ``(valid, ...)`` tensors that a tap
    folded from ``(batch, tokens, ...)`` to leave padding out
    (``host.padding``); its dim still names an axis of the unfolded tensor.
    """

    kind = pb.REDUCER_KIND_PER_CHANNEL
    reads_upcast = True

    def __init__(self, field: str, dim: int | None, max_channels: int, *, tokens: bool = False) -> None:
        super().__init__(field)
        #: The dim the spec gave, None when it gave none.
        self.asked = dim
        # Other models' default is always dim 1: fill it in, so the spec echoes
        # it and an explicit 1 is the same reducer. A token model's default
        # depends on each tensor's shape and stays None.
        self.dim = 1 if dim is None and not tokens else dim
        self.max_channels = max_channels
        self.tokens = self.dim is None
        #: Reads tensors folded from ``(batch, tokens, ...)`` to ``(valid, ...)``.
        self.fold = False

    def folded(self) -> PerChannelReducer:
        """This reducer for ``(valid, ...)`` tensors folded from ``(batch, tokens, ...)``.

        An explicit dim names an axis of the unfolded tensor: 2 and up count
        one less, a negative one is unchanged. Without one the channels are
        the last axis, the hidden unit of ``(batch, tokens, hidden)``.

        Raises:
            SpecError: An explicit dim 0 or 1: the batch and token axes are folded into one.
        """
        if self.asked is not None and 0 <= self.asked < 2:
            raise SpecError(f"{self.field}.per_channel.dim",
                            f"dim {self.asked} is the {'batch' if self.asked == 0 else 'token'} axis, which leaving "
                            "padding out folds away; name a feature axis (e.g. -1 or 2), or keep the padding "
                            "(keep_padding=true, --keep-padding)")
        twin = PerChannelReducer(self.field, self.asked, self.max_channels, tokens=self.tokens)
        twin.fold = True
        return twin

    def spec(self) -> pb.ReducerSpec:
        params = pb.PerChannelParams(dim=self.dim, max_channels=self.max_channels)
        return pb.ReducerSpec(kind=self.kind, per_channel=params)

    def key(self) -> tuple[object, ...]:
        return (self.kind, self.dim, self.tokens, self.max_channels, self.fold)

    def _dim(self, shape: Sequence[int]) -> int:
        """The dim as asked, or the default feature axis of ``shape``; for a folded tensor, of the unfolded one."""
        if self.fold:
            return self.asked if self.asked is not None else len(shape)
        return self.dim if self.dim is not None else default_feature_axis(len(shape), tokens=self.tokens)

    def _axis(self, shape: Sequence[int]) -> int:
        if self.fold:
            return self._folded_axis(shape)
        ndim = len(shape)
        dim = self._dim(shape)
        if not -ndim <= dim < ndim:
            said = f"dim {dim}" if self.dim is not None else f"the default feature axis (dim {dim})"
            raise SpecError(
                f"{self.field}.per_channel.dim",
                f"{said} is out of range for a {ndim}-d tensor of shape {list(shape)}",
            )
        return dim % ndim

    def _folded_axis(self, shape: Sequence[int]) -> int:
        """The axis of a ``(valid, ...)`` tensor: never 0, the positions that were batch and tokens."""
        ndim = len(shape)  # the unfolded tensor had one more
        dim = self._dim(shape)
        axis = dim - 1 if dim >= 0 else dim + ndim
        if not 1 <= axis < ndim:
            said = f"dim {dim}" if self.asked is not None else "the default feature axis (the last)"
            raise SpecError(
                f"{self.field}.per_channel.dim",
                f"{said} of a {ndim + 1}-d (batch, tokens, ...) tensor whose padding is left out "
                f"(folded to {list(shape)}) is {'the batch or token axis' if -ndim - 1 <= dim < ndim + 1 else 'out of range'}; "
                "name a feature axis, or keep the padding (keep_padding=true, --keep-padding)",
            )
        return axis

    def check(self, shape: Sequence[int]) -> None:
        self._axis(shape)

    def _reported(self, shape: Sequence[int]) -> int:
        return min(int(shape[self._axis(shape)]), self.max_channels)

    def width(self, shape: Sequence[int]) -> int:
        return 3 * self._reported(shape)  # [mean * c, std * c, abs_max * c]

    def compute(self, ws: Workspace) -> torch.Tensor:
        x = ws.x
        axis = self._axis(x.shape)
        c = self._reported(x.shape)
        if c == 0 or ws.numel == 0:
            return x.new_full((3 * c,), math.nan, dtype=F64)
        xc = x.narrow(axis, 0, c)
        fin = ws.fin
        fin = fin.narrow(axis, 0, c) if fin is not None else None
        # The float64 channels, non-finite -> NaN so that nansum skips them.
        # Reuse the shared upcast when another reducer made it (or x is
        # float64), else upcast privately and clean in place.
        if ws.has_xd or x.dtype == F64:
            xd = ws.xd.narrow(axis, 0, c)
            z = torch.nan_to_num(xd, math.nan, math.nan, math.nan) if ws.floating else xd.clone()
        else:
            z = xc.to(F64)
            if ws.floating:
                z.nan_to_num_(math.nan, math.nan, math.nan)
        if x.dim() == 1:
            # Each element is its own channel; reducing over an empty dim
            # tuple would reduce over everything, so add a unit dim instead.
            xc, z = xc.unsqueeze(1), z.unsqueeze(1)
            fin = fin.unsqueeze(1) if fin is not None else None
            dims: tuple[int, ...] = (1,)
        else:
            dims = tuple(d for d in range(x.dim()) if d != axis)
        if fin is None:
            count = z.new_full((c,), ws.numel // int(x.shape[axis]))
            # Integers: no NaN, and abs_max is exact from the float64 extremes.
            absmax = torch.maximum(z.amax(dims), z.amin(dims).neg())
        else:
            count = fin.sum(dims, dtype=ws.count_dtype)
            # Exact in the native dtype, with non-finite values -> 0.
            absmax = torch.nan_to_num(xc, 0.0, 0.0, 0.0).abs_().amax(dims)
        # Two passes per channel (mean, then squared deviations) keep the std
        # accurate when |mean| >> std; channels are few, the extra pass small.
        mean = z.nansum(dims) / count  # 0/0 = NaN for channels without finite elements
        z.sub_(mean.reshape([c if d == axis else 1 for d in range(z.dim())])).square_()
        std = (z.nansum(dims) / count).sqrt()
        absmax = torch.where(count > 0, absmax, math.nan)
        return torch.cat([mean, std, absmax])

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        c = len(values) // 3
        return pb.ReducerResult(
            per_channel=pb.PerChannel(
                dim=self._dim(shape),
                mean=values[:c].tolist(),
                std=values[c : 2 * c].tolist(),
                abs_max=values[2 * c :].tolist(),
                channels=int(shape[self._axis(shape)]),
            )
        )
