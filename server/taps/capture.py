"""Captures: the real tensors at chosen layers, from live traffic or a client input.

A :class:`CaptureSession` installs hooks for the duration of one ``Capture``
call. Hooks clone the (sliced, downcast) tensor on its device; the byte cap is
checked from shapes first, so an oversized pass copies nothing. The RPC
thread, not the model thread, moves the tensors to the host and chunks them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from layertap.server.codec import TORCH_BY_WIRE, dtype_name, wire_dtype
from layertap.server.errors import CAPTURE_TOO_LARGE, InvalidSpec, LimitExceeded, Unsupported, unknown_layer
from layertap.server.host.hooks import HookHandle
from layertap.server.host.model_host import ModelHost, PassContext, flatten_tensors
from layertap.v1 import tensor_pb2
from layertap.v1 import telemetry_pb2 as pb

CHUNK_BYTES = 1 << 20
DOWNCASTS = {tensor_pb2.DATA_TYPE_FLOAT16, tensor_pb2.DATA_TYPE_BFLOAT16}


#: Layers come from the model, so requests only need their length capped
#: before the lookup (and the "did you mean" search behind a miss).
MAX_LAYER_NAME = 1024
MAX_CAPTURE_LAYERS = 4096


class CaptureTooLarge(LimitExceeded):
    """A pass needs more bytes than ``--max-capture-bytes`` allows."""

    reason = CAPTURE_TOO_LARGE


@dataclass
class CaptureLimits:
    max_bytes: int = 256 << 20
    max_passes: int = 16
    max_concurrent: int = 8


@dataclass
class CapturedTensor:
    layer: str
    call_index: int
    output_index: int
    output_key: str
    output_count: int
    is_container: bool
    tensor: torch.Tensor


@dataclass
class CapturedPass:
    ctx: PassContext
    ordinal: int
    tensors: list[CapturedTensor] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0
    too_large: str | None = None


@dataclass(frozen=True)
class CaptureOptions:
    layers: tuple[str, ...]
    point: int
    passes: int
    max_batch: int
    dtype: torch.dtype | None


def parse_options(req: pb.CaptureRequest, host: ModelHost, limits: CaptureLimits) -> CaptureOptions:
    """Validate a CaptureRequest against the model and the server limits."""
    if not host.loaded.hooks_supported:
        raise Unsupported(
            f"model source {host.loaded.source!r} does not support module hooks "
            "(TorchScript refuses Python hooks); Capture needs an eager, export or factory model"
        )
    if not req.layers:
        raise InvalidSpec("layers", "name at least one layer (see ListLayers)")
    if len(req.layers) > MAX_CAPTURE_LAYERS:
        raise InvalidSpec("layers", f"at most {MAX_CAPTURE_LAYERS} layers per capture, got {len(req.layers)}")
    known = host.modules
    for i, name in enumerate(req.layers):
        if len(name) > MAX_LAYER_NAME:
            raise InvalidSpec(f"layers[{i}]", f"a layer name is at most {MAX_LAYER_NAME} characters, got {len(name)}")
        if name not in known or not name:
            raise unknown_layer(name, host.layer_names, field=f"layers[{i}]")
    point = req.point or pb.POINT_OUTPUT
    if point not in (pb.POINT_OUTPUT, pb.POINT_INPUT):
        raise InvalidSpec("point", "Capture supports POINT_OUTPUT and POINT_INPUT; use taps for gradients")
    passes = req.passes or 1
    if req.inputs and req.passes > 1:
        raise InvalidSpec("passes", "an active capture (with inputs) runs exactly one pass")
    if passes > limits.max_passes:
        raise LimitExceeded(f"passes={passes} exceeds the server limit of {limits.max_passes}")
    dtype = None
    if req.dtype:
        if req.dtype not in DOWNCASTS:
            raise InvalidSpec("dtype", "downcast must be DATA_TYPE_FLOAT16 or DATA_TYPE_BFLOAT16")
        dtype = TORCH_BY_WIRE[req.dtype]
    return CaptureOptions(tuple(dict.fromkeys(req.layers)), point, passes, req.max_batch, dtype)


class CaptureSession:
    """Hooks for one Capture call; yields :class:`CapturedPass` objects."""

    def __init__(self, host: ModelHost, opts: CaptureOptions, *, max_bytes: int, active: bool) -> None:
        self.host = host
        self.opts = opts
        self.max_bytes = max_bytes
        self.active = active
        self._passes: queue.Queue[CapturedPass] = queue.Queue()
        self._pending: CapturedPass | None = None
        self._taken = 0
        self._handles: list[HookHandle] = []
        self._closed = False

    # -- lifecycle -----------------------------------------------------------
    def open(self) -> None:
        """Install hooks between passes (the model lock keeps passes whole)."""
        with self.host.pass_lock():
            for layer in self.opts.layers:
                self._handles.append(
                    self.host.hooks.add(layer, self.opts.point, lambda ctx, v, _l=layer: self._on_hook(_l, ctx, v))
                )
            self.host.add_observer(self)

    def close(self) -> None:
        """Remove every hook; safe to call more than once, from any thread.

        Never takes the model lock, so gRPC's callback thread never waits for a pass.
        """
        if self._closed:
            return
        self._closed = True
        self.host.remove_observer(self)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> CaptureSession:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- model thread --------------------------------------------------------
    def _wants(self, ctx: PassContext) -> bool:
        if self.active:
            return ctx.active_owner is self
        return not ctx.active and self._taken < self.opts.passes

    def _on_hook(self, layer: str, ctx: PassContext, value: Any) -> None:
        if not self._wants(ctx):
            return
        if self._pending is None or self._pending.ctx is not ctx:
            self._pending = CapturedPass(ctx, self._taken)
        rec = self._pending
        call = rec.calls.get(layer, 0)
        rec.calls[layer] = call + 1
        if rec.too_large:
            return
        items = flatten_tensors(value)
        # A one-argument input comes back like an output; several as a list.
        is_container = not isinstance(value, torch.Tensor) and not (
            self.opts.point == pb.POINT_INPUT and isinstance(value, tuple) and len(items) == 1
        )
        planned = []
        for key, t in items:
            shape = list(t.shape)
            if self.opts.max_batch and shape:
                shape[0] = min(shape[0], self.opts.max_batch)
            dtype = self.opts.dtype if (self.opts.dtype and t.dtype.is_floating_point) else t.dtype
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            planned.append((key, t, dtype, n))
        need = rec.nbytes + sum(p[3] for p in planned)
        if need > self.max_bytes:
            rec.too_large = (
                f"capture too large: pass {ctx.index} needs at least {need} bytes by layer {layer!r}, "
                f"over the server cap of {self.max_bytes} bytes (--max-capture-bytes); "
                "use max_batch or a float16/bfloat16 downcast"
            )
            rec.tensors.clear()  # free device copies already made for this pass
            return
        rec.nbytes = need
        for i, (key, t, dtype, _n) in enumerate(planned):
            src = t.detach()
            if self.opts.max_batch and src.dim():
                src = src[: self.opts.max_batch]
            # clone() so later in-place ops in the model cannot change what we send.
            copy = src.to(dtype=dtype, copy=True) if dtype != src.dtype else src.clone()
            rec.tensors.append(CapturedTensor(layer, call, i, key if isinstance(value, dict) else "",
                                              len(planned), is_container, copy))

    def pass_finished(self, ctx: PassContext) -> None:
        if self._closed or not self._wants(ctx):
            return
        if ctx.failed:
            # The forward raised: a passive capture waits for the next good pass.
            self._pending = None
            return
        rec = self._pending if self._pending is not None and self._pending.ctx is ctx else CapturedPass(ctx, self._taken)
        self._pending = None
        self._taken += 1
        self._passes.put(rec)

    # -- RPC thread ----------------------------------------------------------
    def next_pass(self, timeout: float) -> CapturedPass | None:
        try:
            return self._passes.get(timeout=timeout)
        except queue.Empty:
            return None


def check_all_ran(rec: CapturedPass, opts: CaptureOptions) -> None:
    """Every requested layer produced a tensor in this pass, or FAILED_PRECONDITION.

    A module the forward never calls (an auxiliary head, a branch not taken)
    would otherwise end the stream with nothing for it.
    """
    seen = {c.layer for c in rec.tensors}
    for i, layer in enumerate(opts.layers):
        if layer not in seen:
            raise Unsupported(
                f"layers[{i}]: module {layer!r} did not run in pass {rec.ctx.index} (or gave no tensor at "
                f"this point); the forward never calls it for this input", field=f"layers[{i}]")


def encode_pass(rec: CapturedPass, opts: CaptureOptions, tensor_ids: Iterator[int]) -> Iterator[pb.CaptureResponse]:
    """Headers and <=1 MiB chunks for every tensor of a pass, in request order."""
    rank = {name: i for i, name in enumerate(opts.layers)}
    point = opts.point
    order = sorted(rec.tensors, key=lambda c: (rank[c.layer], c.call_index, c.output_index))
    for cap in order:
        host_t = cap.tensor.to("cpu").contiguous()
        nbytes = host_t.numel() * host_t.element_size()
        # A byte view of the tensor itself: each chunk is copied once, into its message.
        data = host_t.view(-1).view(torch.uint8).numpy().data if nbytes else memoryview(b"")
        tid = next(tensor_ids)
        nchunks = (nbytes + CHUNK_BYTES - 1) // CHUNK_BYTES
        yield pb.CaptureResponse(header=pb.CaptureHeader(
            tensor_id=tid, layer=cap.layer, point=point, output_index=cap.output_index,
            output_key=cap.output_key, output_count=cap.output_count, dtype=wire_dtype(host_t.dtype),
            shape=list(host_t.shape), pass_index=rec.ctx.index, pass_ordinal=rec.ordinal,
            total_bytes=nbytes, num_chunks=nchunks, active=rec.ctx.active,
            is_container=cap.is_container, call_index=cap.call_index,
        ))
        for i in range(nchunks):
            off = i * CHUNK_BYTES
            msg = pb.CaptureResponse()
            chunk = msg.chunk
            chunk.tensor_id = tid
            chunk.chunk_index = i
            chunk.offset = off
            chunk.data = data[off:off + CHUNK_BYTES].tobytes()
            yield msg


class CaptureSlots:
    """Counts concurrent captures against the server limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self.active = 0

    def acquire(self) -> None:
        with self._lock:
            if self.active >= self.limit:
                raise LimitExceeded(
                    f"{self.active} captures already running, the server limit is {self.limit}; retry later"
                )
            self.active += 1

    def release(self) -> None:
        with self._lock:
            self.active -= 1


def describe(opts: CaptureOptions) -> str:
    """Log-safe description (never tensor data)."""
    dt = dtype_name(opts.dtype) if opts.dtype else "native"
    return f"layers={list(opts.layers)} point={opts.point} passes={opts.passes} max_batch={opts.max_batch} dtype={dt}"


