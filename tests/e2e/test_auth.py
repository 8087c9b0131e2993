"""Tokens and scopes against a real server: the interceptor, ownership, reload, audit."""

from __future__ import annotations

import hashlib
import logging
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.e2e import wait_for
from support.hostile import INFERENCE, TELEMETRY
from support.rpc_table import methods, probe

import layertap
from layertap.server.rpc import auth
from layertap.v1 import inference_pb2, inference_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.e2e

SCOPES = ("infer", "read", "tap", "capture", "admin")
TOKENS = {name: f"tok-{name}-0123456789abcdef" for name in (*SCOPES, "alice", "bob", "root", "old")}


def line(tid: str, scopes: str, expiry: str = "") -> str:
    return f"{tid} sha256:{hashlib.sha256(TOKENS[tid].encode()).hexdigest()} {scopes} {expiry}".rstrip()


def write_tokens(path: Path, *lines: str) -> Path:
    path.write_text("# id digest scopes [expiry]\n\n" + "\n".join(lines) + "\n")
    return path


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    return write_tokens(
        tmp_path / "tokens",
        *(line(s, s) for s in SCOPES),
        line("alice", "infer,read,tap,capture"),
        line("bob", "infer,read,tap"),
        line("root", "infer,read,tap,capture,admin"),
        line("old", "infer,read", "2020-01-01T00:00:00Z"),
    )


@pytest.fixture
def secured(make_server, token_file):
    return make_server(auth_tokens=str(token_file), metrics_port=0)


def client(srv, who: str | None) -> layertap.Client:
    return layertap.Client(f"127.0.0.1:{srv.port}", token=TOKENS[who] if who else "")


# Minimal requests (support.rpc_table's probes): each fails fast past the interceptor (or succeeds), never
# waits for traffic. Every method of the served services, read from their descriptors.
SERVED = {f"/{m.containing_service.full_name}/{m.name}": (name, m) for name, m in methods().items()
          if m.containing_service.full_name in (INFERENCE, TELEMETRY)}
PROBES = {path: probe(name) for path, (name, _m) in SERVED.items()}


def call_raw(channel: grpc.Channel, method: str, token: str | None) -> grpc.StatusCode:
    """The status of one raw call (OK, or the failure's code)."""
    request = PROBES[method]
    descriptor = SERVED[method][1]
    streaming = descriptor.server_streaming
    response_type = message_factory.GetMessageClass(descriptor.output_type)
    metadata = [("authorization", f"Bearer {token}")] if token else None
    make = channel.unary_stream if streaming else channel.unary_unary
    rpc = make(method, request_serializer=type(request).SerializeToString,
               response_deserializer=response_type.FromString)
    try:
        result = rpc(request, timeout=10, metadata=metadata)
        if streaming:
            next(iter(result))
            result.cancel()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_every_rpc_has_a_scope():
    """The table covers exactly the methods of both services' descriptors."""
    served = {f"/{s.full_name}/{m.name}" for s in auth.SERVED_SERVICES for m in s.methods}
    table = {f"/{svc}/{m}" for svc, methods in auth.METHOD_SCOPES.items() for m in methods}
    assert served == table == set(PROBES)
    assert {auth.SERVED_SERVICES[0].full_name, auth.SERVED_SERVICES[1].full_name} == set(auth.METHOD_SCOPES)
    assert all(scope in auth.SCOPES for scope in auth.method_scopes().values())


def test_unassigned_method_is_refused(secured):
    """A method missing from the table is PERMISSION_DENIED even for an all-scope token."""
    secured.auth._scopes = {k: v for k, v in secured.auth._scopes.items() if not k.endswith("/GetServerStats")}
    with client(secured, "root") as c, pytest.raises(layertap.PermissionDenied) as err:
        c.stats()
    assert err.value.reason == "PERMISSION_DENIED"
    assert err.value.metadata["method"] == "/layertap.v1.TelemetryService/GetServerStats"


@pytest.mark.parametrize("scope", SCOPES)
def test_each_scope_allows_exactly_its_methods(secured, scope):
    channel = grpc.insecure_channel(f"127.0.0.1:{secured.port}")
    try:
        for method in PROBES:
            code = call_raw(channel, method, TOKENS[scope])
            expected = auth.method_scopes()[method] == scope
            assert (code != grpc.StatusCode.PERMISSION_DENIED) == expected, (scope, method, code)
            assert code != grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()


def test_no_wrong_and_expired_tokens_are_unauthenticated(secured):
    for who, token in ((None, ""), ("wrong", "not-a-token"), ("expired", TOKENS["old"])):
        with layertap.Client(f"127.0.0.1:{secured.port}", token=token) as c, pytest.raises(layertap.Unauthenticated) as err:
            c.metadata()
        assert err.value.code == "UNAUTHENTICATED" and err.value.reason == "UNAUTHENTICATED", who
    with client(secured, "read") as c, pytest.raises(layertap.PermissionDenied) as denied:
        c.capture("layer1", input=np.zeros((1, 3, 8, 8), np.float32))
    assert denied.value.metadata["scope"] == "capture"


def test_token_from_environment(secured, monkeypatch):
    monkeypatch.setenv("LAYERTAP_TOKEN", TOKENS["infer"])
    with layertap.Client(f"127.0.0.1:{secured.port}") as c:
        assert c.metadata().model_name


def test_health_open_and_reflection_needs_a_token(secured):
    channel = grpc.insecure_channel(f"127.0.0.1:{secured.port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(refl.ServerReflectionInfo(iter([ask]), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(refl.ServerReflectionInfo(iter([ask]), timeout=5,
                                                 metadata=[("authorization", f"Bearer {TOKENS['admin']}")]))
        names = {s.name for s in replies[0].list_services_response.service}
        assert "layertap.v1.TelemetryService" in names
    finally:
        channel.close()


def test_taps_belong_to_their_creator(secured):
    with client(secured, "alice") as alice, client(secured, "bob") as bob, client(secured, "root") as root:
        tap = alice.create_tap("layer1", reducers=["moments"], name="alices")
        assert tap.owner == "alice"
        assert [t.owner for t in bob.taps()] == ["alice"]
        with pytest.raises(layertap.PermissionDenied) as err:
            bob.delete_tap(tap.id)
        assert err.value.metadata["scope"] == "admin"
        assert [t.id for t in bob.taps()] == [tap.id]  # read: listed, not deletable
        alice.delete_tap(tap.id)
        tap = bob.create_tap("layer2", reducers=["moments"])
        root.delete_tap(tap.id)  # admin may
        assert root.taps() == []


def test_a_taken_tap_name_is_already_exists_for_its_owner_and_denied_to_others(secured):
    """Another principal's name is PERMISSION_DENIED (it is not the caller's to reuse); the owner's
    own, and admin's (who may delete the holder), ALREADY_EXISTS. Both name the field."""
    with client(secured, "alice") as alice, client(secured, "bob") as bob, client(secured, "root") as root:
        alice.create_tap("layer1", reducers=["moments"], name="shared")
        with pytest.raises(layertap.PermissionDenied) as denied:
            bob.create_tap("layer2", reducers=["moments"], name="shared")
        assert (denied.value.code, denied.value.field) == ("PERMISSION_DENIED", "spec.name")
        assert denied.value.metadata["owner"] == "alice" and "'alice'" in str(denied.value)
        with pytest.raises(layertap.PermissionDenied) as denied:
            next(iter(bob.watch("layer2", reducers=["moments"], name="shared")))
        assert denied.value.field == "stream_taps[0].name"
        for who in (alice, root):
            with pytest.raises(layertap.AlreadyExists) as taken:
                who.create_tap("layer2", reducers=["moments"], name="shared")
            assert (taken.value.code, taken.value.field) == ("ALREADY_EXISTS", "spec.name")
            assert str(taken.value).startswith("spec.name: ")  # the message names the field too
        assert [(t.id, t.owner, t.layers) for t in bob.taps()] == [("shared", "alice", ["layer1"])]


def test_baseline_of_another_principal_needs_admin(secured):
    with client(secured, "alice") as alice, client(secured, "bob") as bob, client(secured, "root") as root:
        alice.set_baseline("layer1", passes=2)
        with pytest.raises(layertap.PermissionDenied):
            bob.set_baseline("layer1", passes=2)
        root.set_baseline("layer1", passes=2)
        with pytest.raises(layertap.PermissionDenied):
            alice.set_baseline("layer1", passes=2)  # now root's


def test_baseline_ids_and_reservoirs_are_not_anyone_s(secured):
    """SetBaseline's default ids cannot be taken first by another principal's tap, and a
    baseline's builders (samples of the layer's values) are exported to their owner or admin."""
    from layertap.server.drift.names import baseline_tap_id

    squat = baseline_tap_id(telemetry_pb2.SetBaselineRequest(selector="layer3"))
    with client(secured, "alice") as alice, client(secured, "bob") as bob:
        with pytest.raises(layertap.InvalidArgument) as err:
            bob.create_tap("layer3", reducers=["moments"], name=squat)
        assert err.value.field == "spec.name"
        with pytest.raises(layertap.InvalidArgument) as err:
            next(iter(bob.watch("layer3", reducers=["moments"], name="baseline-mine")))
        assert err.value.field == "stream_taps[0].name"
        with pytest.raises(layertap.InvalidArgument) as err:  # nor by naming a SetBaseline into it
            bob.set_baseline("layer1", passes=2, name=squat)
        assert err.value.field == "name"
        info = alice.set_baseline("layer3", passes=2)
        assert info.tap == squat
        export = telemetry_pb2.ExportBaselineRequest(tap=squat)
        for who, code in (("bob", grpc.StatusCode.PERMISSION_DENIED), ("alice", None), ("root", None)):
            with grpc.insecure_channel(f"127.0.0.1:{secured.port}") as ch:
                stub = telemetry_pb2_grpc.TelemetryServiceStub(ch)
                try:
                    layers = stub.ExportBaseline(export, timeout=10, metadata=[("authorization", f"Bearer {TOKENS[who]}")])
                    assert code is None and [x.layer for x in layers.layers] == ["layer3"], who
                except grpc.RpcError as exc:
                    assert exc.code() == code, (who, exc)


def test_stream_taps_need_tap_scope(secured):
    with client(secured, "read") as c, pytest.raises(layertap.PermissionDenied) as err:
        next(iter(c.watch("layer1", reducers=["moments"])))
    assert err.value.metadata["scope"] == "tap"


def test_reload_revokes_and_bad_reload_keeps_table(secured, token_file, caplog):
    with client(secured, "bob") as c:
        assert c.layers()
        text = token_file.read_text()
        token_file.write_text("".join(ln + "\n" for ln in text.splitlines() if not ln.startswith("bob ")))
        secured.reload()
        with pytest.raises(layertap.Unauthenticated):
            c.layers()
    token_file.write_text("alice sha256:nothex read\n")
    with caplog.at_level(logging.ERROR, logger="layertap.server.auth"):
        assert secured.auth.reload() is False
    assert "tokens:1" in caplog.text or f"{token_file}:1" in caplog.text
    with client(secured, "alice") as c:
        assert c.layers()  # the old table is kept


def test_failure_counter_counts_by_reason(secured):
    def value(reason: str) -> float:
        return secured.state.registry.get_sample_value("layertap_auth_failures_total", {"reason": reason}) or 0.0

    before_u, before_p = value("UNAUTHENTICATED"), value("PERMISSION_DENIED")
    for _ in range(2):
        with layertap.Client(f"127.0.0.1:{secured.port}", token="nope") as c, pytest.raises(layertap.Unauthenticated):
            c.layers()
    with client(secured, "infer") as c, pytest.raises(layertap.PermissionDenied):
        c.layers()
    assert value("UNAUTHENTICATED") == before_u + 2
    assert value("PERMISSION_DENIED") == before_p + 1


def test_token_never_logged(secured, caplog):
    with caplog.at_level(logging.DEBUG):
        with client(secured, "infer") as c, pytest.raises(layertap.PermissionDenied):
            c.layers()
        with layertap.Client(f"127.0.0.1:{secured.port}", token="secret-guess-123") as c:
            with pytest.raises(layertap.Unauthenticated):
                c.layers()
        with client(secured, "alice") as c:
            c.layers()
    assert "infer" in caplog.text and "ListLayers" in caplog.text  # the principal and the method are
    for token in (*TOKENS.values(), "secret-guess-123"):
        assert token not in caplog.text


def test_anonymous_without_auth(make_server):
    srv = make_server()
    with layertap.Client(f"127.0.0.1:{srv.port}", token="whatever") as c:
        tap = c.create_tap("layer1", reducers=["moments"])
        assert tap.owner == "anonymous"
        c.delete_tap(tap.id)


@pytest.mark.parametrize("bad, where", [
    ("alice sha256:abc read", ":3: digest"),
    ("alice", ":3: expected"),
    (line("alice", "read,fly"), ":3: scopes"),
    (line("alice", "read", "tomorrow"), ":3: expiry"),
])
def test_malformed_file_names_the_line(tmp_path, bad, where):
    path = write_tokens(tmp_path / "tokens", bad)
    with pytest.raises(auth.TokenFileError, match=where):
        auth.parse_token_file(path)


def test_a_repeated_id_is_reported_before_the_line_s_expiry(tmp_path):
    """As the server always checked: digest and scopes, then a repeated id, then the expiry."""
    path = write_tokens(tmp_path / "tokens", line("alice", "read"), line("alice", "read", "tomorrow"))
    with pytest.raises(auth.TokenFileError, match=":4: token id 'alice' appears twice"):
        auth.parse_token_file(path)


def test_malformed_file_stops_serve(tmp_path, serve_process):
    import subprocess
    import sys

    path = write_tokens(tmp_path / "tokens", "alice sha256:abc read")
    proc = subprocess.run([sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--no-metrics",
                           "--auth-tokens", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert errors == [ln for ln in errors if f"{path}:3" in ln] and len(errors) == 1, proc.stderr


def test_sighup_revokes_a_token(tmp_path, serve_process):
    path = write_tokens(tmp_path / "tokens", line("alice", "read"), line("bob", "read"))
    srv = serve_process("--no-metrics", "--auth-tokens", str(path))
    with layertap.Client(srv.address, token=TOKENS["bob"]) as c:
        assert c.layers()
        path.write_text(line("alice", "read") + "\n")
        srv.proc.send_signal(signal.SIGHUP)

        def revoked() -> bool:
            try:
                c.layers()
            except layertap.Unauthenticated:
                return True
            return False

        assert wait_for(revoked, timeout=10)
    with layertap.Client(srv.address, token=TOKENS["alice"]) as c:
        assert c.layers()
    assert srv.proc.poll() is None


def test_token_new_cli(capsys, tmp_path):
    from layertap.cli import main

    assert main(["token", "new", "--id", "carol", "--scopes", "infer,read"]) == 0
    out = capsys.readouterr().out
    token = out.split("token: ", 1)[1].split()[0]
    entry = out.strip().splitlines()[-1]
    assert token not in entry and entry.startswith("carol sha256:")
    (principal, _),  = auth.parse_token_file(write_tokens(tmp_path / "t", entry))
    assert principal.scopes == {"infer", "read"}
    assert main(["token", "new", "--id", "carol", "--scopes", "fly"]) == 2


def test_expiry_is_checked_at_call_time(tmp_path):
    path = write_tokens(tmp_path / "tokens", line("alice", "read", "2030-01-01T00:00:00Z"))
    now = [time.time()]
    a = auth.Authenticator(str(path), clock=lambda: now[0])
    assert a.authenticate(TOKENS["alice"])[0] is not None
    now[0] = 1_900_000_000.0
    assert a.authenticate(TOKENS["alice"]) == (None, "expired token of 'alice'")


def test_cli_token_flag_and_environment(secured, capsys, monkeypatch):
    from layertap.cli import main

    address = f"127.0.0.1:{secured.port}"
    monkeypatch.delenv("LAYERTAP_TOKEN", raising=False)
    assert main(["stats", address]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["stats", address, "--token", TOKENS["read"]]) == 0
    monkeypatch.setenv("LAYERTAP_TOKEN", TOKENS["read"])
    assert main(["layers", address]) == 0
    assert main(["taps", address, "--token", TOKENS["infer"]]) == 1
    err = capsys.readouterr().err
    assert "PERMISSION_DENIED" in err and TOKENS["infer"] not in err


class _StallingProxy:
    """Forwards a client's first ``limit`` bytes to the server, then stalls the upload (the reply flows)."""

    def __init__(self, port: int, limit: int) -> None:
        import socket
        import threading

        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target, self._limit = port, limit
        self._socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        upstream = socket.create_connection(("127.0.0.1", self._target))
        self._socks += [conn, upstream]
        threading.Thread(target=self._pipe, args=(conn, upstream, self._limit), daemon=True).start()
        threading.Thread(target=self._pipe, args=(upstream, conn, None), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(1 << 16):
                if limit is not None:
                    data = data[:max(0, limit - sent)]
                    if not data:
                        continue  # keep reading (the client's window stays open), forward nothing
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass

    def close(self) -> None:
        for sock in (self._listener, *self._socks):
            sock.close()


def test_a_refused_call_is_answered_without_reading_its_request(secured):
    """Without a valid token (or scope) the server answers before the message arrives: it never
    buffers and parses up to --max-message-bytes for a caller it refuses (a stalled upload of a
    200 MiB request used to pin 200 MiB of server memory per call, for as long as it stalled)."""
    from layertap.v1 import tensor_pb2

    request = inference_pb2.InferRequest(inputs=[tensor_pb2.Tensor(
        dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[1 << 24, 1], raw_data=bytes(64 << 20))])
    for token, code in (("not-a-token", grpc.StatusCode.UNAUTHENTICATED),
                        (TOKENS["read"], grpc.StatusCode.PERMISSION_DENIED)):
        proxy = _StallingProxy(secured.port, limit=1 << 20)  # the server sees 1 MiB of the 64
        try:
            with grpc.insecure_channel(f"127.0.0.1:{proxy.port}",
                                       options=[("grpc.max_send_message_length", -1)]) as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    stub.Infer(request, timeout=20, metadata=[("authorization", f"Bearer {token}")])
                assert err.value.code() == code, err.value  # not DEADLINE_EXCEEDED: nothing waited for the rest
        finally:
            proxy.close()
