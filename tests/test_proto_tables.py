"""Scopes, error reasons and dtypes: each declared once, and unchanged on the wire.

The pinned tables below are what the server and the CLI did before these facts
moved into the protos (issue 22); they change only on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent

#: The scopes of the RPCs that existed in 2026-12 (was server/rpc/auth.py's METHOD_SCOPES): tokens in use rely
#: on them. A new RPC declares its own `(required_scope)` in its proto and needs no line here.
PINNED_SCOPES = {
    "/layertap.v1.InferenceService/Infer": "infer",
    "/layertap.v1.InferenceService/GetModelMetadata": "infer",
    "/layertap.v1.InferenceService/Generate": "infer",
    "/layertap.v1.TelemetryService/ListLayers": "read",
    "/layertap.v1.TelemetryService/Capture": "capture",
    "/layertap.v1.TelemetryService/CreateTap": "tap",
    "/layertap.v1.TelemetryService/DeleteTap": "tap",
    "/layertap.v1.TelemetryService/ListTaps": "read",
    "/layertap.v1.TelemetryService/Subscribe": "read",
    "/layertap.v1.TelemetryService/SetBaseline": "tap",
    "/layertap.v1.TelemetryService/GetDrift": "read",
    "/layertap.v1.TelemetryService/GetServerStats": "read",
    "/layertap.v1.TelemetryService/ListIncidents": "capture",
    "/layertap.v1.TelemetryService/GetIncident": "capture",
    "/layertap.v1.TelemetryService/DeleteIncident": "capture",
    "/layertap.v1.TelemetryService/Explain": "capture",
    "/layertap.v1.TelemetryService/ExportBaseline": "tap",
    "/layertap.v1.TelemetryService/InstallBaseline": "tap",
    "/layertap.v1.TelemetryService/SetDriftFalseAlarmRate": "admin",
}
#: Scope names in the order messages list them.
PINNED_SCOPE_NAMES = ("infer", "read", "tap", "capture", "admin")

#: Every ErrorInfo.reason the server sent before ErrorReason existed.
PINNED_REASONS = {
    "INTERNAL", "NOT_FOUND", "INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED", "ALREADY_EXISTS",
    "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "UNAVAILABLE",
    "LAYER_NOT_FOUND", "CAPTURE_TOO_LARGE", "CAPTURE_BUDGET_EXHAUSTED", "CAPTURE_OUT_OF_MEMORY",
    "CAPTURE_COPY_FAILED", "RECORDER_OFF", "OUTPUT_NOT_CLASSES", "INFERENCE_TENSOR_CACHED", "TRAINING_AGENT",
    "CANNOT_GENERATE", "NO_TOKENIZER", "NONFINITE_LOGITS",
}

#: Wire dtype name -> (numpy-style name, torch dtype, numpy storage of the bytes), in enum order.
PINNED_DTYPES = [
    ("DATA_TYPE_FLOAT32", "float32", "torch.float32", "<f4"),
    ("DATA_TYPE_FLOAT16", "float16", "torch.float16", "<f2"),
    ("DATA_TYPE_BFLOAT16", "bfloat16", "torch.bfloat16", "<u2"),
    ("DATA_TYPE_FLOAT64", "float64", "torch.float64", "<f8"),
    ("DATA_TYPE_INT8", "int8", "torch.int8", "|i1"),
    ("DATA_TYPE_INT16", "int16", "torch.int16", "<i2"),
    ("DATA_TYPE_INT32", "int32", "torch.int32", "<i4"),
    ("DATA_TYPE_INT64", "int64", "torch.int64", "<i8"),
    ("DATA_TYPE_UINT8", "uint8", "torch.uint8", "|u1"),
    ("DATA_TYPE_BOOL", "bool", "torch.bool", "|b1"),
]


# --------------------------------------------------------------------------- scopes


def _proto_methods() -> dict[str, object]:
    """``/pkg.Service/Method`` -> MethodDescriptor, for every service of every generated layertap.v1 file."""
    import importlib

    out: dict[str, object] = {}
    for path in sorted((REPO / "client" / "v1").glob("*_pb2.py")):
        module = importlib.import_module(f"layertap.v1.{path.stem}")
        for service in module.DESCRIPTOR.services_by_name.values():
            out.update({f"/{service.full_name}/{m.name}": m for m in service.methods})
    return out


def test_every_rpc_declares_its_scope():
    from layertap.v1 import options_pb2

    methods = _proto_methods()
    assert set(PINNED_SCOPES) <= set(methods), "an RPC was removed or renamed: old clients call it"
    missing = [name for name, m in methods.items() if not m.GetOptions().Extensions[options_pb2.required_scope]]
    assert not missing, f"add `option (required_scope) = SCOPE_...;` to {missing}"
    declared = {name: options_pb2.Scope.Name(m.GetOptions().Extensions[options_pb2.required_scope])
                for name, m in methods.items()}
    assert {name: declared[name] for name in PINNED_SCOPES} == {
        name: f"SCOPE_{scope.upper()}" for name, scope in PINNED_SCOPES.items()}


def test_method_scopes_are_unchanged():
    """The server's table is the proto's options: a pinned RPC keeps its scope, a new one brings its own."""
    from layertap.server.rpc import auth
    from layertap.v1 import options_pb2

    scopes = auth.method_scopes()
    assert {name: scopes[name] for name in PINNED_SCOPES} == PINNED_SCOPES
    assert scopes == {name: options_pb2.Scope.Name(m.GetOptions().Extensions[options_pb2.required_scope])
                      .removeprefix("SCOPE_").lower() for name, m in _proto_methods().items()}
    assert tuple(auth.SCOPES) == PINNED_SCOPE_NAMES


def test_token_new_output_is_unchanged(capsys):
    from layertap.cli import main

    assert main(["token", "new", "--id", "carol", "--scopes", " read, infer ", "--expires", "2030-01-01T00:00:00Z"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("token: ") and out[1].startswith("add this line to the --auth-tokens file")
    tid, dig, scopes, expiry = out[2].split()
    assert (tid, scopes, expiry) == ("carol", "read,infer", "2030-01-01T00:00:00Z")
    assert dig.startswith("sha256:") and len(dig) == 7 + 64
    assert main(["token", "new", "--id", "two words", "--scopes", "read"]) == 2
    assert capsys.readouterr().err == (
        "layertap: token new: --id must be one word; --scopes some of infer,read,tap,capture,admin\n")


def test_token_file_round_trip():
    """A line the CLI writes is a line the server reads, with the same digest."""
    import hashlib

    from layertap.server.rpc import auth

    token, entry = auth.new_token("dora", ["tap", "read"])
    tid, dig, scopes = entry.split()
    assert (tid, scopes, dig) == ("dora", "tap,read", "sha256:" + hashlib.sha256(token.encode()).hexdigest())
    assert auth.digest(token) == dig


# --------------------------------------------------------------------------- error reasons


def _reason_literals() -> set[str]:
    """Reason strings written in the server's source: ``reason="..."`` and ``reason = "..."``."""
    found: set[str] = set()
    for path in (REPO / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                values = [k.value for k in node.keywords if k.arg == "reason"]
            elif isinstance(node, ast.Assign):
                values = [node.value] if any(isinstance(t, ast.Name) and t.id == "reason" for t in node.targets) else []
            else:
                continue
            found.update(v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return found - {"ended", "replaced", "expired", "deleted"}  # tap removal reasons, not ErrorInfo


def _class_reasons() -> set[str]:
    import layertap.server.taps.capture  # noqa: F401 - defines the capture errors
    from layertap.server.errors import LayertapServerError

    out: set[str] = set()
    todo = [LayertapServerError]
    while todo:
        cls = todo.pop()
        out.add(cls.reason)
        todo.extend(cls.__subclasses__())
    return out


def test_wire_reasons_are_unchanged():
    """ErrorReason's values travel as they did before the enum: no ERROR_REASON_ prefix."""
    from layertap._errors import REASONS, wire_reason
    from layertap.v1 import errors_pb2

    assert REASONS == PINNED_REASONS
    assert wire_reason(errors_pb2.ERROR_REASON_LAYER_NOT_FOUND) == "LAYER_NOT_FOUND"


def test_every_reason_the_server_writes_is_an_error_reason():
    from layertap._errors import REASONS

    assert _reason_literals() | _class_reasons() <= REASONS
    assert {"RECORDER_OFF", "OUTPUT_NOT_CLASSES", "TRAINING_AGENT", "CAPTURE_COPY_FAILED"} <= _reason_literals()


def test_client_reason_classes_are_unchanged():
    from layertap import _errors

    assert _errors._BY_REASON == {"LAYER_NOT_FOUND": _errors.LayerNotFound, "CAPTURE_TOO_LARGE": _errors.CaptureTooLarge}


# --------------------------------------------------------------------------- dtypes


def test_server_dtype_table_is_unchanged():
    from layertap.server import codec
    from layertap.v1 import tensor_pb2

    assert [(tensor_pb2.DataType.Name(k), str(v)) for k, v in codec.TORCH_BY_WIRE.items()] == [
        (wire, torch_name) for wire, _, torch_name, _ in PINNED_DTYPES]
    assert [(k, str(v)) for k, v in codec.DTYPE_BY_NAME.items()] == [
        (name, torch_name) for _, name, torch_name, _ in PINNED_DTYPES]
    assert {v: k for k, v in codec.TORCH_BY_WIRE.items()} == codec.WIRE_BY_TORCH


def test_client_dtype_table_is_unchanged():
    from layertap import _codec
    from layertap.v1 import tensor_pb2

    table = [(tensor_pb2.DataType.Name(k), name, storage) for k, (name, storage) in _codec._DTYPES.items()]
    assert [(w, n, s.str) for w, n, s in table] == [(w, n, s) for w, n, _, s in PINNED_DTYPES]
    assert all(s == np.dtype(p) for (_, _, s), (*_, p) in zip(table, PINNED_DTYPES))
    assert list(_codec._BY_NAME) == [name for _, name, _, _ in PINNED_DTYPES]
    assert _codec._FROM_NUMPY == {
        ("f", 4): 1, ("f", 2): 2, ("f", 8): 4, ("i", 1): 5, ("i", 2): 6, ("i", 4): 7, ("i", 8): 8, ("u", 1): 9, ("b", 1): 10}
    assert [_codec.dtype_name(c) for c in range(11)] == ["unspecified", *(n for _, n, _, _ in PINNED_DTYPES)]
