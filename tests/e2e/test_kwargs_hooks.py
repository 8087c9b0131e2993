"""Input hooks on modules called with keyword arguments: a real server, the real client, local hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.e2e import wait_for
from support.kwargs_models import TOKENS, VOCAB, keyword_block, keyword_block_loaded, tiny_llama, tiny_llama_loaded

import layertap
from layertap.v1 import telemetry_pb2

pytestmark = pytest.mark.e2e

ATTN = "model.layers.0.self_attn"


def local_inputs(model: torch.nn.Module, layer: str, x: torch.Tensor) -> tuple[tuple, dict]:
    """A local pre-hook's view of ``layer``'s call: (args, kwargs)."""
    got: dict[str, tuple] = {}
    handle = model.get_submodule(layer).register_forward_pre_hook(
        lambda _m, a, k: got.__setitem__("call", (a, k)), with_kwargs=True)
    with torch.inference_mode():
        model(x)
    handle.remove()
    return got["call"]


def collect(stream, expected: int) -> list:
    """The summaries of one pass, ``expected`` of them."""
    out = []
    for s in stream:
        out.append(s)
        if len(out) == expected:
            break
    return out


def test_llama_attention_input_is_captured_by_keyword(make_server):
    srv = make_server(tiny_llama_loaded(seed=0))
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, TOKENS))
    args, kwargs = local_inputs(tiny_llama(seed=0), ATTN, torch.from_numpy(ids))
    assert args == ()  # Hugging Face calls its attention with keywords only
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        got = client.capture(ATTN, input=ids, point="input")
    assert isinstance(got, dict)
    # attention_mask is None here, the cache and use_cache are no tensors: skipped.
    assert list(got) == ["hidden_states", "position_ids", "position_embeddings.0", "position_embeddings.1"]
    np.testing.assert_array_equal(got["hidden_states"], kwargs["hidden_states"].numpy())
    np.testing.assert_array_equal(got["position_ids"], kwargs["position_ids"].numpy())
    for i in (0, 1):
        np.testing.assert_array_equal(got[f"position_embeddings.{i}"], kwargs["position_embeddings"][i].numpy())


def test_llama_attention_input_tap_names_hidden_states(make_server):
    srv = make_server(tiny_llama_loaded(seed=0))
    ids = np.random.default_rng(1).integers(0, VOCAB, (3, TOKENS))
    _args, kwargs = local_inputs(tiny_llama(seed=0), ATTN, torch.from_numpy(ids))
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with client.watch(ATTN, point="input", reducers=["moments"], timeout=60) as stream:
            assert wait_for(lambda: client.stats().active_hooks == 1)
            client.infer(ids)
            got = collect(stream, 4)
        assert client.taps() == []
    assert [(s.output_index, s.output_key) for s in got] == [
        (0, "hidden_states"), (1, "position_ids"), (2, "position_embeddings.0"), (3, "position_embeddings.1")]
    assert {s.point for s in got} == {"input"}
    for s in got:
        name, _, index = s.output_key.partition(".")
        local = kwargs[name] if not index else kwargs[name][int(index)]
        ref = local.numpy().astype(np.float64)
        m = s.results["moments"]
        assert m.count == ref.size
        np.testing.assert_allclose(m.mean, ref.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m.std, ref.std(), rtol=1e-4, atol=1e-6)


def test_plain_module_keywords_positions_and_skipped_non_tensors(make_server):
    srv = make_server(keyword_block_loaded())
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    model = keyword_block()
    kw_args, kw_kwargs = local_inputs(model, "kw", torch.from_numpy(x))
    pos_args, pos_kwargs = local_inputs(model, "pos", torch.from_numpy(x))
    assert kw_args == () and len(pos_args) == 1
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        kw = client.capture("kw", input=x, point="input")
        pos = client.capture("pos", input=x, point="input")
        lin = client.capture("lin", input=x, point="input")  # called positionally: as before
        with client.watch("pos", point="input", reducers=["moments"], timeout=60) as stream:
            assert wait_for(lambda: client.stats().active_hooks == 1)
            client.infer(x)
            summaries = collect(stream, 4)
    assert list(kw) == ["x", "scale", "pair.0", "pair.1"]  # cache and flag are skipped
    np.testing.assert_array_equal(kw["x"], kw_kwargs["x"].numpy())
    np.testing.assert_array_equal(kw["pair.1"], kw_kwargs["pair"][1].numpy())
    # Mixed: the positional tensor is keyed by its position.
    assert list(pos) == ["0", "scale", "pair.0", "pair.1"]
    np.testing.assert_array_equal(pos["0"], pos_args[0].numpy())
    np.testing.assert_array_equal(pos["scale"], pos_kwargs["scale"].numpy())
    assert isinstance(lin, np.ndarray)
    np.testing.assert_array_equal(lin, x)
    assert [(s.output_index, s.output_key) for s in summaries] == [(0, ""), (1, "scale"), (2, "pair.0"), (3, "pair.1")]
    np.testing.assert_allclose(summaries[1].results["moments"].mean,
                               pos_kwargs["scale"].numpy().astype(np.float64).mean(), rtol=1e-5)



def test_trigger_and_replay_on_a_keyword_input(make_server, tmp_path):
    """The flight recorder reads keyword-input summaries and replays the pass to their tensors."""
    import json

    path = tmp_path / "taps.json"
    path.write_text(json.dumps({"taps": [{"name": "guard", "selector": "kw", "point": "input",
                                          "reducers": ["abs_max", "nonfinite"], "triggers": {"abs_max_above": 50.0}}]}))
    srv = make_server(keyword_block_loaded(), incident_dir=str(tmp_path / "inc"), record_inputs=16,
                      tap_config=str(path))
    x = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.infer(x)
        client.infer(x * 1e4)
    assert srv.state.taps.flush(10)
    assert srv.state.recorder is not None and srv.state.recorder.wait_idle(30)
    (rec,) = srv.state.recorder.store.entries()
    assert rec.triggers == ["abs_max"] and rec.replayed, rec.replay_note
    assert rec.tensor_count >= 1
    assert srv.state.taps.get("guard").spec.point == telemetry_pb2.POINT_INPUT
