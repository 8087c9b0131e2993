"""Explain: Captum's attributions of the caller's input, by method, one internal batch per pass."""

from __future__ import annotations

import dataclasses
import math
import time

import grpc

from layertap.server.codec import tensor_from_proto, tensor_to_proto
from layertap.server.errors import InvalidField, LimitExceeded, grpc_errors, status_for, unknown_layer
from layertap.server.explain.explainer import default_layer, explain, require_hooks
from layertap.server.explain.options import (
    DEFAULT_STEPS,
    GRAD_CAM,
    INTEGRATED_GRADIENTS,
    LAYER_INTEGRATED_GRADIENTS,
    LAYERED,
    METHODS,
    SALIENCY,
    STEPPED,
    ExplainOptions,
)
from layertap.server.explain.passes import ExplainPasses
from layertap.server.limits import MAX_EXPLAIN_STEPS
from layertap.server.rpc.inference import decode_inputs
from layertap.server.rpc.state import ServerState, StateBacked
from layertap.server.taps.capture_options import MAX_LAYER_NAME
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["ExplainServicer", "explain_options"]

#: ``ExplainMethod`` -> method name; UNSPECIFIED is Grad-CAM, as before the field existed.
_METHODS = {pb.EXPLAIN_METHOD_UNSPECIFIED: GRAD_CAM, pb.EXPLAIN_METHOD_GRAD_CAM: GRAD_CAM,
            pb.EXPLAIN_METHOD_INTEGRATED_GRADIENTS: INTEGRATED_GRADIENTS,
            pb.EXPLAIN_METHOD_LAYER_INTEGRATED_GRADIENTS: LAYER_INTEGRATED_GRADIENTS,
            pb.EXPLAIN_METHOD_SALIENCY: SALIENCY}
_METHOD_CODES = {name: code for code, name in _METHODS.items() if code}
assert set(_METHOD_CODES) == set(METHODS)
#: ``BaselineKind`` -> baseline name ("" = zeros, or the given tensor when there is one).
_BASELINES = {pb.BASELINE_KIND_UNSPECIFIED: "", pb.BASELINE_KIND_ZEROS: "zeros", pb.BASELINE_KIND_GIVEN: "given",
              pb.BASELINE_KIND_NOISE: "noise"}
#: A deadline further away than this is no deadline (grpc's time_remaining without one).
_NO_DEADLINE = 1e8


def _method(request: pb.ExplainRequest) -> str:
    method = _METHODS.get(request.method)
    if method is None:
        raise InvalidField("method", f"unknown method {request.method}; expected one of "
                                     f"{', '.join(pb.ExplainMethod.Name(c) for c in _METHOD_CODES.values())}")
    return method


def _layer(request: pb.ExplainRequest, method: str, state: ServerState) -> str:
    name = request.layer
    if method not in LAYERED:
        if name:
            raise InvalidField("layer", f"{method} attributes the main input; layer is for "
                                        f"{' and '.join(LAYERED)} (leave it empty)")
        return ""
    host = state.host
    if not name:
        if method == LAYER_INTEGRATED_GRADIENTS:
            require_hooks(host)  # before the default: a TorchScript model lists no modules
            return default_layer(host)
        raise InvalidField("layer", "name the layer to explain, e.g. the last convolutional block (see ListLayers)")
    if len(name) > MAX_LAYER_NAME:
        raise InvalidField("layer", f"a layer name is at most {MAX_LAYER_NAME} characters, got {len(name)}")
    require_hooks(host)  # before the name: a TorchScript model lists no modules
    if name not in host.modules:
        raise unknown_layer(name, host.layer_names, field="layer")
    return name


def _refuse_unless(method: str, wanted: tuple[str, ...], **given: object) -> None:
    """Fields the method does not read must be left unset: a caller who sets one expects an effect."""
    for field, value in given.items():
        if value:
            raise InvalidField(field, f"{method} does not take {field}; it is for {', '.join(wanted)}")


def _steps(request: pb.ExplainRequest) -> int:
    if request.n_steps > MAX_EXPLAIN_STEPS:
        raise InvalidField("n_steps", f"at most {MAX_EXPLAIN_STEPS} steps, got {request.n_steps}")
    return request.n_steps or DEFAULT_STEPS


def _baseline(request: pb.ExplainRequest, state: ServerState, opts: ExplainOptions) -> ExplainOptions:
    """``opts`` with the request's baseline."""
    kind = _BASELINES.get(request.baseline_kind)
    if kind is None:
        raise InvalidField("baseline_kind", f"unknown baseline kind {request.baseline_kind}; expected one of "
                                            f"{', '.join(pb.BaselineKind.Name(k) for k in _BASELINES if k)}")
    given = request.HasField("baseline")
    kind = kind or ("given" if given else "zeros")
    if kind == "given" and not given:
        raise InvalidField("baseline", "BASELINE_KIND_GIVEN needs the baseline tensor")
    if kind != "given" and given:
        raise InvalidField("baseline", f"a baseline tensor goes with BASELINE_KIND_GIVEN, not {kind}")
    if kind != "noise" and (request.noise_std or request.seed):
        raise InvalidField("noise_std" if request.noise_std else "seed", "only for BASELINE_KIND_NOISE")
    if not (math.isfinite(request.noise_std) and request.noise_std >= 0):
        raise InvalidField("noise_std", f"must be finite and at least 0 (0 = 1.0), got {request.noise_std}")
    tensor = None
    if given:
        raw = request.baseline.raw_data
        cap = state.config.max_request_bytes
        if len(raw) > cap:
            raise LimitExceeded(f"the baseline carries {len(raw)} tensor bytes, over --max-request-bytes={cap}",
                                field="baseline", metadata={"max_bytes": str(cap)})
        tensor = tensor_from_proto(request.baseline, "baseline", raw)
    return dataclasses.replace(opts, baseline=kind, baseline_tensor=tensor, noise_std=request.noise_std or 1.0,
                               seed=request.seed)


def _batch_rows(request: pb.ExplainRequest, state: ServerState) -> int:
    cap = max(1, state.config.max_explain_batch)
    if request.internal_batch_size > cap:
        raise InvalidField("internal_batch_size", f"at most the server's --max-explain-batch={cap} rows, "
                                                  f"got {request.internal_batch_size}")
    return request.internal_batch_size or cap


def explain_options(request: pb.ExplainRequest, state: ServerState) -> ExplainOptions:
    """Check the request's fields against the model, before the inputs are decoded."""
    if not request.inputs:
        raise InvalidField("inputs", "send the input to explain (see GetModelMetadata)")
    method = _method(request)
    layer = _layer(request, method, state)
    if method != GRAD_CAM:
        _refuse_unless(method, (GRAD_CAM,), normalize=request.normalize, upsample=request.upsample)
    opts = ExplainOptions(method, layer, tuple(request.targets), request.normalize, request.upsample,
                          request.output_name, batch_rows=_batch_rows(request, state))
    if method not in STEPPED:
        _refuse_unless(method, STEPPED, n_steps=request.n_steps, baseline_kind=request.baseline_kind,
                       baseline=request.HasField("baseline"), noise_std=request.noise_std, seed=request.seed)
        return opts
    return _baseline(request, state, dataclasses.replace(opts, n_steps=_steps(request)))


def _deadline(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE else time.monotonic() + remaining


class ExplainServicer(StateBacked):
    """Which parts of an input (or of a layer) the chosen outputs answer to."""

    @grpc_errors
    def Explain(self, request: pb.ExplainRequest, context: grpc.ServicerContext) -> pb.ExplainResponse:
        state = self.state
        start = time.perf_counter()
        method, code, passes = _METHODS.get(request.method, "unknown"), "OK", None
        try:
            opts = explain_options(request, state)
            # Same byte cap, shape and dtype checks as Infer; a training agent refuses here.
            inputs = decode_inputs(list(request.inputs), state)
            passes = ExplainPasses(state.host, deadline=_deadline(context), alive=context.is_active)
            found = explain(state.host, inputs, opts, passes)
        except Exception as exc:
            code = "CANCELLED" if passes is not None and passes.cancelled else status_for(exc)[0].name
            raise
        finally:
            if state.metrics is not None:
                state.metrics.record_explain(method, code, time.perf_counter() - start,
                                             passes.batches if passes is not None else 0)
        resp = pb.ExplainResponse(targets=found.targets.tolist(), scores=found.scores.tolist(),
                                  method=_METHOD_CODES[found.method], layer=found.layer, n_steps=found.n_steps,
                                  internal_batches=found.batches, tokens=found.tokens)
        if found.method == GRAD_CAM:
            resp.maps.CopyFrom(tensor_to_proto(found.attributions, "maps"))
        else:
            resp.attributions.CopyFrom(tensor_to_proto(found.attributions, "attributions"))
        if found.deltas is not None:
            resp.deltas.extend(found.deltas.tolist())
        return resp
