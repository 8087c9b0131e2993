"""The basic statistics of a pass's small tensors, computed together when the pass ends.

Why: at batch-1 decode every hooked tensor is a few KiB (a Llama layer's
``(1, 1, 512)`` output), and a per-tensor reduction is almost all fixed cost:
the compiled kernel's call, the workspace, the shift's random draw. Paid
between the model's layers, that code also runs ~3x slower than outside
(benchmarks/decode_hook_cost.py: 1.05-1.1 ms per decode step for 8 hooks).
So a hook on a small floating tensor only copies it (one small device copy,
no sync, in the tensor's own layout), and at the pass's end the copies of one
shape and dtype are stacked into ``(rows, n)``, each row the tensor in logical
order, reduced row-wise in one set of ops, and handed to the pass buffer as
one block.

Each row's statistics are the basic-statistics vector of
:func:`~layertap.server.reducers.kernels.fused_basic_stats` with every need
set (the layout every basic reducer reads), including the moments shift: K is
the median of the finite values among 16 strided and 16 random elements of the
row, as :func:`~layertap.server.reducers.kernels.shift_of` picks it. Rows never
mix: a row's values depend on its own elements and its random positions only.

Float64 and integer tensors, large tensors and the rest keep the per-tensor
path: the single-read compiled kernel is cheaper once a tensor is big enough
that reading it dominates, and float64's overflow handling differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from layertap.server.reducers.kernel_slot import StatsKernel
from layertap.server.reducers.kernels import StatNeeds, fused_basic_stats
from layertap.server.reducers.stats_body import SHIFT_SAMPLE, batched_stats_body
from layertap.server.reducers.workspace import F64, Workspace

__all__ = ["BATCH_DTYPES", "MAX_BATCH_BYTES", "MAX_BATCH_NUMEL", "PassBatch", "Row", "batched_basic_stats"]

#: Tensors of at most this many elements are batched (see docs/benchmarks.md, "decode hook cost").
MAX_BATCH_NUMEL = 8192
#: Copies held per pass at most; past it, tensors take the per-tensor path.
MAX_BATCH_BYTES = 16 << 20
#: Dtypes whose float64 upcast cannot overflow ``x - K``: every non-finite value of it is x's own.
BATCH_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def batched_basic_stats(x: torch.Tensor, generator: torch.Generator, kernel: StatsKernel | None = None) -> torch.Tensor:
    """Row-wise basic statistics of a ``(rows, n)`` tensor of a :data:`BATCH_DTYPES` dtype, ``n > SHIFT_SAMPLE``.

    ``kernel``'s compiled kernel once its signature is ready, else the same
    body eagerly (:mod:`.stats_body`). Each row draws its own random shift positions.

    Returns:
        ``(rows, BASIC_WIDTH)`` float64, each row laid out as
        ``[zeros, nan, count_finite, sum(x-K), sum((x-K)**2), K, min, max]``
        over the row's finite elements (zeros and nan over all).
    """
    rows, n = x.shape
    if rows == 1:
        # Alone in its group: the per-tensor kernel, the same vector (a batch kernel compiled for
        # several rows would take one row as a guard miss, and costs more for one).
        ws = Workspace(x[0], generator)
        out = kernel.stats(ws, _ALL) if kernel is not None else None
        return (out if out is not None else fused_basic_stats(ws, _ALL))[None]
    rnd = torch.randint(0, n, (rows, SHIFT_SAMPLE), generator=generator, device=x.device)
    out = kernel.batch_stats(x, rnd) if kernel is not None else None
    if out is not None:
        return out
    on = _ON.get(x.device)
    if on is None:
        on = _ON[x.device] = torch.ones((1,), dtype=F64, device=x.device)
    # Eagerly, every op writes a (rows, n) temporary, several in float64: in chunks of rows, so a full
    # batch never needs more than a few MiB at once (the compiled kernel fuses them away).
    step = max(1, _EAGER_ELEMENTS // n)
    if rows <= step:
        return batched_stats_body(x, rnd, on)
    return torch.cat([batched_stats_body(x[i:i + step], rnd[i:i + step], on) for i in range(0, rows, step)])


#: The shift switch, on, per device (see ``compile.kernel``).
_ON: dict[torch.device, torch.Tensor] = {}
#: Every basic statistic: a batch fills every slot, whatever its plans read.
_ALL = StatNeeds(zeros=True, nan=True, count=True, sums=True, shifted=True, minmax=True)
#: Elements per eager chunk: float64 temporaries of 1 MiB each.
_EAGER_ELEMENTS = 1 << 17


#: A batch group: tensors of one device, dtype and shape, stacked into one ``(rows, numel)`` block.
_Group = tuple[torch.device, torch.dtype, torch.Size]


class Row:
    """A deferred tensor's place: its group and row; every piece (buffer key) that reads its statistics."""

    __slots__ = ("group", "index", "keys")

    def __init__(self, group: _Group, index: int) -> None:
        self.group, self.index = group, index
        self.keys: list[int] = []


class PassBatch:
    """One pass's deferred small tensors: copies taken in hooks, reduced together by :meth:`finish`.

    Model thread only. A copy, not the tensor itself: the model may write the
    tensor in place later in the same pass.
    """

    def __init__(self, seed: int = 0, kernel: StatsKernel | None = None) -> None:
        self.seed = seed
        #: The compiled statistics kernel (``app.py``'s); None: eager.
        self.kernel = kernel
        #: Each group's copies and their rows, in row order.
        self._groups: dict[_Group, list[tuple[torch.Tensor, Row]]] = {}
        self._bytes = 0
        self._generators: dict[torch.device, torch.Generator] = {}

    def __len__(self) -> int:
        return sum(len(group) for group in self._groups.values())

    def defer(self, x: torch.Tensor) -> Row | None:
        """Copies ``x`` for the pass's end and returns its row, or None when it takes the per-tensor path."""
        n = x.numel()
        if x.dtype not in BATCH_DTYPES or not SHIFT_SAMPLE < n <= MAX_BATCH_NUMEL or x.layout != torch.strided \
                or type(x) is not torch.Tensor:
            return None
        size = n * x.element_size()
        if self._bytes + size > MAX_BATCH_BYTES:
            return None
        self._bytes += size
        key = (x.device, x.dtype, x.shape)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = []
        # One op in the model's forward: a dense copy in x's own layout; rows are laid out at the end.
        row = Row(key, len(group))
        group.append(((x.detach() if x.requires_grad else x).clone(), row))
        return row

    def finish(self, add_rows: Callable[[list[list[int]], torch.Tensor], None],
               failed: Callable[[list[int], Exception], None]) -> list[int]:
        """Reduces every group and gives each its block of statistics, with each row's keys
        (``add_rows(keys, block)``, as :meth:`PassBuffer.add_rows` takes them); returns the keys given.

        A group whose reduction raises, or whose block ``add_rows`` refuses,
        gives ``failed`` its keys and the error; the other groups are
        unaffected. The batch is emptied first.
        """
        groups = self._groups
        self._groups, self._bytes = {}, 0
        given: list[int] = []
        for group, items in groups.items():
            tensors = [t for t, _ in items]
            keys = [row.keys for _, row in items]
            try:
                # Under inference mode whatever the pass's modes: one kernel signature serves every pass.
                with torch.inference_mode():
                    # Row-major, each row in the tensor's logical order (a view of a contiguous stack).
                    stacked = (torch.stack(tensors) if len(tensors) > 1 else tensors[0][None]).reshape(len(tensors), -1)
                    add_rows(keys, batched_basic_stats(stacked, self._generator(group[0]), self.kernel))
                given.extend(k for row_keys in keys for k in row_keys)
            except Exception as exc:  # noqa: BLE001 - a reducer must never fail inference
                failed([k for row_keys in keys for k in row_keys], exc)
        return given

    def discard(self) -> None:
        self._groups, self._bytes = {}, 0

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.seed)
        return gen

