"""Baseline ids are SetBaseline's: who may take one, and which error a request sees first.

The check moved from the RPCs into a sink the drift monitor answers; these pin
that it still runs before every other field of the spec, for a principal's
taps only: the server's own (``--taps``) may take any name, as they always could.
"""

from __future__ import annotations

import json

import pytest

import layertap

pytestmark = pytest.mark.e2e


def test_a_reserved_name_is_refused_before_any_other_field(make_server) -> None:
    srv = make_server()
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        # A selector that matches nothing would be NOT_FOUND; the name is checked first.
        with pytest.raises(layertap.InvalidArgument) as err:
            client.create_tap("no.such.layer", reducers=["moments"], name="baseline-x")
        assert err.value.field == "spec.name" and "SetBaseline's own" in str(err.value)
        with pytest.raises(layertap.InvalidArgument) as err:
            next(iter(client.watch("no.such.layer", reducers=["moments"], name="baseline-y")))
        assert err.value.field == "stream_taps[0].name"
        assert client.taps() == []


def test_a_taps_file_may_name_a_tap_like_a_baseline(make_server, tmp_path) -> None:
    path = tmp_path / "taps.json"
    path.write_text(json.dumps({"taps": [{"name": "baseline-ops", "selector": "layer1", "reducers": ["moments"]}]}))
    srv = make_server(tap_config=str(path))
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        assert [t.id for t in client.taps()] == ["baseline-ops"]
