"""Reducers: summarize a tapped tensor on its device, then move a pass's results to host in one copy.

Modules, in dependency order: :mod:`.spec` (names, defaults, bounds and
validation; host-only), :mod:`.samplesort` (sorting a bounded sample),
:mod:`.workspace` (per-tensor shared state),
:mod:`.kernels` (the shared basic statistics and the no-sync rules),
:mod:`.base`, :mod:`.basic`, :mod:`.distribution` and :mod:`.latency` (the reducers),
:mod:`.plan` (``build_reducers`` and the fused ``ReducerPlan``), :mod:`.batched`
(a pass's small tensors reduced together at its end) and
:mod:`.transfer` (the device-to-host copy and its thread).

Semantics (also the contract for decoders and exporters):

* ``moments``: count, mean and population std (ddof=0) of the FINITE elements;
  NaN and +-Inf are left to ``nonfinite``. Sums are accumulated in float64
  around a shift taken from the tensor itself, so huge magnitudes (1e30 in
  float32) and large offsets with a small spread stay accurate. (Only float64
  inputs beyond ~1e154 can overflow the sum of squares: std and norm -> inf.)
* ``minmax``/``abs_max``: over finite elements; NaN when there is none.
* ``zero_fraction``: exact zeros (+0 and -0) over ALL elements; ``count`` is
  that denominator (the element count), so fractions merge by weighting.
* ``nonfinite``: NaN and +-Inf counts.
* ``norm``: L2 norm of the finite elements (0 for an empty tensor).
* ``histogram``: frozen edges with open end bins; NaN is not binned, +-Inf land
  in the open end bins. Counts are exact; above ``sample_size`` elements a
  uniform sample (with replacement) of exactly ``sample_size`` elements is
  binned instead, and ``sample_size`` reports how many were binned. Binning
  is a binary search of the edges in the sorted sample when quantiles sort the
  same sample anyway, on CUDA (no atomics) and for CPU samples above 2,048
  elements (sorted on integer keys), else bucketize plus a scatter into the
  few bins of the bounded sample.
* ``quantiles``: numpy's default ('linear') interpolation on the NaN-free
  sample; exact order statistics when the tensor fits in the sample. NaN is
  excluded (it is counted by ``nonfinite``), +-Inf are ordinary extreme values.
  ``rank_error`` is the DKW bound ``sqrt(ln(2/delta) / (2 n)) + 1/n`` with
  ``delta = 0.01`` over the ``n`` non-NaN sampled values (the ``1/n`` covers
  the discreteness of a sample quantile), and 0 when unsampled.
* ``per_channel``: mean, std and abs_max of the finite elements of each slice
  along ``dim``, for the first ``max_channels`` channels.
* ``latency``: seconds from the module's last forward pre-hook to its first
  forward hook (``perf_counter`` on CPU, CUDA events on GPU); it reads no
  tensor and writes no slot, the tap's timer measures it (see :mod:`.latency`),
  and it needs point ``output``.
* Integer and bool tensors are read as float64 (exact up to 2**53).
"""
