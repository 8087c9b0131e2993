"""Review (issue 25, tokens off): stalled non-Health calls are never cancelled, so one connection stops every RPC.

Without ``--auth-tokens`` every caller is one principal and the principal share is off; what is
left is the server-wide bound (2 x --workers = 16 here). Calls outside Health have no read
deadline (OpenPool's READ_TIMEOUT covers Health only), so a stranger who opens 16 ListLayers with
HEADERS and 2 prefix bytes, and answers the server's pings, holds all 16 places and all 8
workers for as long as the connection lives: every other non-Health call (Infer included) is
RESOURCE_EXHAUSTED. Expected: a call still without its request after a bounded time (Health
uses 10 s) is cancelled and its place given back.
"""

from __future__ import annotations

import time

import grpc
import pytest
from support.h2abuse import LIST_LAYERS, H2Client

#: Longer than OpenPool's READ_TIMEOUT (10 s), the bound Health's stalled calls get.
HOLD = 13.0


@pytest.mark.timeout(60)
def test_stalled_calls_without_tokens_do_not_refuse_others_for_ever(make_server):
    srv = make_server(workers=8, max_streams=4)
    attacker = H2Client(srv.port)
    for _ in range(16):
        attacker.start(LIST_LAYERS, b"\x00\x00", end=False)
    attacker.flush()
    end = time.monotonic() + HOLD
    while time.monotonic() < end:  # stays a live peer: answers pings, sends nothing more
        attacker.pump(0.2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            try:
                ch.unary_unary(LIST_LAYERS)(b"", timeout=5)
                outcome = "OK"
            except grpc.RpcError as exc:
                outcome = f"{exc.code().name}: {exc.details()}"
        in_flight = srv.principals.calls.pool()[0] if srv.principals.calls else None
        resets = dict(attacker.server_resets)
    finally:
        attacker.close()
    assert outcome == "OK", (outcome, f"calls in flight {in_flight}", f"server resets {resets}")
