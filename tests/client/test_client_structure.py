"""The client keeps one way to the server and no back doors between its objects.

Read with ``ast`` (nothing is imported): only the transport (with the channel
and the Capture wire method it builds on) touches stubs and channels, and no
client module reads another object's ``_private`` attributes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CLIENT = Path(__file__).resolve().parents[2] / "client"
GENERATED = CLIENT / "v1"

#: Modules that may build channels, stubs or multi-callables.
WIRE_MODULES = {"_transport.py", "_channel.py", "_capture_wire.py"}
#: What a channel or stub is made or reached with.
WIRE_NAMES = {
    "open_channel", "capture_method", "insecure_channel", "secure_channel", "intercept_channel",
    "unary_unary", "unary_stream", "stream_unary", "stream_stream",
}
#: Known exceptions, module -> the private attributes it may still read on others, and why.
PRIVATE_READS_ALLOWED = {
    # Owned elsewhere: the TensorBoard bridge's first-sample capture uses the
    # Client's older private spellings (kept on Client as shims over its transport).
    "_tensorboard.py": {"_translating", "_capture_rpc", "_deadline"},
}


def _modules() -> dict[str, ast.Module]:
    """Every hand-written client module, subpackages (the CLI) included, by its path under ``client/``."""
    return {
        path.relative_to(CLIENT).as_posix(): ast.parse(path.read_text(), str(path))
        for path in sorted(CLIENT.rglob("*.py"))
        if GENERATED not in path.parents
    }


def _import_name(name: str) -> str:
    """``cli/watch.py`` -> ``layertap.cli.watch``; a package's ``__init__.py`` is the package."""
    parts = name.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["layertap", *parts])


def _imported_modules(tree: ast.Module) -> set[str]:
    """Names bound by ``import x`` (modules, whose underscore members are their own business)."""
    return {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}


def test_the_modules_are_found() -> None:
    assert {"_client.py", "_transport.py", "_incidents.py", "_fleet.py", "cli/__init__.py", "cli/watch.py"} <= set(_modules())


def test_only_the_transport_touches_stubs_and_channels() -> None:
    found = []
    for name, tree in _modules().items():
        if name in WIRE_MODULES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                imported = [node.module or ""] + [a.name for a in node.names]
                if any(i.endswith("_pb2_grpc") for i in imported):
                    found.append(f"{name}:{node.lineno}: imports {', '.join(imported)}")
                found += [f"{name}:{node.lineno}: imports {a.name}" for a in node.names if a.name in WIRE_NAMES]
            elif isinstance(node, ast.Import):
                found += [f"{name}:{node.lineno}: imports {a.name}" for a in node.names if a.name.endswith("_pb2_grpc")]
            elif isinstance(node, ast.Attribute) and (node.attr in WIRE_NAMES or node.attr.endswith("Stub")):
                found.append(f"{name}:{node.lineno}: uses .{node.attr}")
            elif isinstance(node, ast.Name) and node.id.endswith("Stub"):
                found.append(f"{name}:{node.lineno}: uses {node.id}")
    assert not found, "only _transport.py may reach the wire:\n" + "\n".join(found)


def test_capture_method_is_built_only_by_the_transport() -> None:
    users = {
        name
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and any(a.name in {"capture_method", "open_channel"} for a in node.names)
    }
    assert users == {"_transport.py"}


def test_no_client_module_reads_another_objects_privates() -> None:
    found = []
    for name, tree in _modules().items():
        modules = _imported_modules(tree)
        allowed = PRIVATE_READS_ALLOWED.get(name, set())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or (attr.startswith("__") and attr.endswith("__")) or attr in allowed:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and (owner.id in {"self", "cls"} or owner.id in modules):
                continue
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "a client module reads another object's private attribute:\n" + "\n".join(found)


def test_no_method_is_grafted_onto_a_class() -> None:
    """A class body defines its methods; ``explain = _explain.explain`` was the old style."""
    found = []
    for name, tree in _modules().items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
                if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) \
                        and value.value.id.startswith("_"):
                    found.append(f"{name}:{stmt.lineno}: {cls.name} borrows {ast.unparse(value)}")
    assert not found, "\n".join(found)


def test_the_allowed_exceptions_are_still_needed() -> None:
    """An exception that no longer occurs is removed from PRIVATE_READS_ALLOWED."""
    modules = _modules()
    for name, attrs in PRIVATE_READS_ALLOWED.items():
        used = {n.attr for n in ast.walk(modules[name]) if isinstance(n, ast.Attribute)}
        assert attrs <= used, f"{name} no longer reads {sorted(attrs - used)}: drop the exception"


def _handles() -> dict[str, object]:
    """Every RPC handle a client module declares, by ``module.NAME``."""
    import importlib

    from layertap._transport import Streaming, Unary

    out: dict[str, object] = {}
    for name in _modules():
        module = importlib.import_module(_import_name(name))
        out.update({f"{name}.{k}": v for k, v in vars(module).items() if isinstance(v, (Unary, Streaming))
                    and all(v is not seen for seen in out.values())})  # an imported handle is its declarer's
    return out


def test_every_rpc_handle_matches_its_proto_method() -> None:
    """Handles live next to the methods that call them; each names a real method with its real types."""
    from google.protobuf import descriptor_pool

    from layertap._transport import Streaming
    from layertap.v1 import inference_pb2, telemetry_pb2  # noqa: F401 - registers the services

    handles = _handles()
    assert len(handles) >= 17, sorted(handles)
    pool = descriptor_pool.Default()
    seen = set()
    for where, rpc in handles.items():
        service = pool.FindServiceByName(f"layertap.v1.{rpc.service}")  # type: ignore[attr-defined]
        method = service.FindMethodByName(rpc.method)  # type: ignore[attr-defined]
        assert method is not None, f"{where}: no method {rpc.path}"  # type: ignore[attr-defined]
        assert rpc.request.DESCRIPTOR.full_name == method.input_type.full_name, where  # type: ignore[attr-defined]
        parsed = rpc.deserialize(b"")  # type: ignore[attr-defined]
        assert parsed.DESCRIPTOR.full_name == method.output_type.full_name, where
        assert isinstance(rpc, Streaming) == method.server_streaming, where
        seen.add(rpc.path)  # type: ignore[attr-defined]
    assert len(seen) == len(handles), "one handle per RPC"
