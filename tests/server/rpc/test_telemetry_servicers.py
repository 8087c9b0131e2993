"""``TelemetryService`` is one proto service served by one servicer per resource, through one handler table.

The table comes from the proto's descriptor: every method exactly once, of
the descriptor's kind, with its messages' serializers. The servicers stay
apart: none reads another's private names (checked on the source with ``ast``).
"""

from __future__ import annotations

import ast
import inspect
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory

from layertap.server.errors import grpc_errors
from layertap.server.rpc import method_handlers
from layertap.server.rpc.method_handlers import kind_of, service_handlers
from layertap.server.rpc.state import StateBacked, StateCell
from layertap.server.rpc.telemetry import SERVICE, SERVICERS, TelemetryService, add_to_server

pytestmark = pytest.mark.unit

RPC_DIR = Path(method_handlers.__file__).resolve().parent
#: Methods whose responses go out as bytes the servicer serialized.
WIRE_BYTES = {"Capture", "Subscribe"}  # Subscribe: serialized by its stream, which times it (rpc.taps.deliver)


class _Recorder:
    """Stands in for grpc.Server: records what a registration adds."""

    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.registered[service] = handlers


def test_the_handler_table_serves_every_method_once_as_the_proto_declares() -> None:
    service = TelemetryService(StateCell())
    names = [m.name for m in SERVICE.methods]
    assert list(service.handlers) == names
    served = Counter(name for s in service.servicers for name in dir(type(s)) if name in names)
    assert served == Counter(names), "each method is defined by exactly one servicer"
    for method in SERVICE.methods:
        handler = service.handlers[method.name]
        assert kind_of(handler) == (method.client_streaming, method.server_streaming), method.name
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        assert handler.request_deserializer == request.FromString, method.name
        want = None if method.name in WIRE_BYTES else response.SerializeToString
        assert handler.response_serializer == want, method.name


def test_one_generic_handler_registers_the_one_service() -> None:
    server = _Recorder()
    add_to_server(TelemetryService(StateCell()), server)  # type: ignore[arg-type]
    assert len(server.generic) == 1
    assert server.generic[0].service_name() == "layertap.v1.TelemetryService"
    assert list(server.registered) == ["layertap.v1.TelemetryService"]
    for method in SERVICE.methods:
        details = SimpleNamespace(method=f"/{SERVICE.full_name}/{method.name}", invocation_metadata=())
        assert server.generic[0].service(details) is server.registered[SERVICE.full_name][method.name]


def test_each_servicer_is_its_own_class_in_its_own_module() -> None:
    assert len({s.__module__ for s in SERVICERS}) == len(SERVICERS)
    for servicer in SERVICERS:
        others = set(SERVICERS) - {servicer}
        assert not others & set(servicer.__mro__), f"{servicer.__name__} inherits another servicer"


def test_a_method_no_servicer_defines_stops_the_server_from_starting() -> None:
    cell = StateCell()
    servicers = [make(cell) for make in SERVICERS if "Explain" not in dir(make)]
    with pytest.raises(ValueError, match=r"no servicer defines Explain"):
        service_handlers(SERVICE, servicers)


def test_a_method_two_servicers_define_stops_the_server_from_starting() -> None:
    cell = StateCell()
    with pytest.raises(ValueError, match=r"more than one servicer defines ListLayers.*LayersServicer, LayersServicer"):
        service_handlers(SERVICE, [make(cell) for make in SERVICERS] + [SERVICERS[0](cell)])


def test_a_servicer_method_the_proto_lacks_stops_the_server_from_starting() -> None:
    class Typo(StateBacked):
        @grpc_errors
        def ListLayer(self, request: Any, context: grpc.ServicerContext) -> Any:
            return None

    cell = StateCell()
    with pytest.raises(ValueError, match=r"Typo.ListLayer: layertap.v1.TelemetryService has no method ListLayer"):
        service_handlers(SERVICE, [make(cell) for make in SERVICERS] + [Typo(cell)])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _class_node(cls: type) -> ast.ClassDef:
    tree = ast.parse(Path(inspect.getsourcefile(cls) or "").read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)


def _defined_privates(node: ast.ClassDef) -> set[str]:
    """Private names a class body defines: methods, class attributes and ``self._x = ...``."""
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                isinstance(sub.value, ast.Name) and sub.value.id == "self":
            names.add(sub.attr)
    return {n for n in names if _private(n)}


def test_no_servicer_reaches_into_another_servicers_private_names() -> None:
    own = {cls: _defined_privates(_class_node(cls)) for cls in SERVICERS}
    base = _defined_privates(_class_node(StateBacked))
    problems = []
    for cls in SERVICERS:
        others = set().union(*(names for other, names in own.items() if other is not cls))
        for node in ast.walk(_class_node(cls)):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if node.attr in others and not (on_self and node.attr in own[cls] | base):
                problems.append(f"{cls.__name__}: .{node.attr} (line {node.lineno}) is another servicer's")
            elif on_self and node.attr not in own[cls] | base:
                problems.append(f"{cls.__name__}: self.{node.attr} (line {node.lineno}) is not its own")
    assert not problems, "\n".join(problems)


def test_no_rpc_module_imports_another_modules_private_names() -> None:
    problems = []
    for path in sorted(RPC_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("layertap.server.rpc"):
                problems += [f"{path.name}: {node.module}.{a.name}" for a in node.names if _private(a.name)]
    assert not problems, "\n".join(problems)
