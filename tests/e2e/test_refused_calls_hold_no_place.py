"""Issue 25: a call the Authenticator refuses (no token, or a scope it lacks) takes no admission place.

The Authenticator names the caller before the interceptors after it run; PrincipalAdmission takes
a principal's share and a server-wide place only for a call that will be served, so refusals
never fill the 2 x --workers bound.
"""

from __future__ import annotations

import grpc
import pytest
from support.h2abuse import LIST_LAYERS
from support.storm import TOKENS, tokens_file

pytestmark = pytest.mark.e2e

INFER = "/layertap.v1.InferenceService/Infer"


def test_refused_calls_take_no_place(make_server, tmp_path):
    srv = make_server(workers=8, max_streams=4, auth_tokens=str(tokens_file(tmp_path / "tokens")))
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        codes = []
        for _ in range(20):  # more than the 16 server-wide places
            for method, md in ((INFER, [("authorization", f"Bearer {TOKENS['reader']}")]), (LIST_LAYERS, [])):
                try:
                    ch.unary_unary(method)(b"", metadata=md, timeout=5)
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
        assert set(codes) == {"PERMISSION_DENIED", "UNAUTHENTICATED"}, codes
        assert srv.principals.calls.pool() == (0, 0)
        assert srv.principals.principals.pool() == (0, 0)
        layers = ch.unary_unary(LIST_LAYERS)(b"", metadata=[("authorization", f"Bearer {TOKENS['reader']}")],
                                             timeout=5)
        assert layers is not None
