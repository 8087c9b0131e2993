"""Padding left out of every statistic on a served Hugging Face model: padding changes nothing.

A tiny random-init Llama, saved with ``save_pretrained`` and served by
``hf:DIR``, gets padded batches (``attention_mask`` zeros on the left or the
right of one row). Each reference is float64 numpy over the valid positions of
a local forward hook's tensor; with right padding (where transformers gives
the valid positions exactly the unpadded sequence's activations) also over the
same sequences run one by one without padding.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

from support import hf_models
from support.e2e import wait_for

from layertap import Client, InvalidArgument
from layertap.v1 import inference_pb2 as ipb
from layertap.v1 import inference_pb2_grpc
from layertap.v1 import telemetry_pb2 as tpb

pytestmark = pytest.mark.e2e

LAYER = hf_models.TINY["llama"][3]  # model.layers.0: (batch, tokens, hidden)
HIDDEN = hf_models.TINY["llama"][2]["hidden_size"]
VOCAB = hf_models.TINY["llama"][2]["vocab_size"]
EDGES = [-0.05, -0.02, -0.01, 0.0, 0.01, 0.02, 0.05]
REDUCERS: list[Any] = ["moments", "minmax", "per_channel", {"histogram": {"edges": EDGES}}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return hf_models.save("llama", tmp_path_factory.mktemp("hf"))


def local(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None,
          position_ids: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """A local forward's ``LAYER`` output and logits, float64."""
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(LAYER).register_forward_hook(
        lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    finally:
        handle.remove()
    return {"layer": seen[0].double().numpy(), "logits": logits.double().numpy()}


def padded(side: str) -> tuple[np.ndarray, np.ndarray]:
    """Three sequences of 6, 4 and 6 tokens padded to 6 on ``side``."""
    ids = np.random.default_rng(7).integers(1, VOCAB, (3, 6))
    mask = np.ones((3, 6), dtype=np.int64)
    cols = slice(0, 2) if side == "left" else slice(4, 6)
    mask[1, cols], ids[1, cols] = 0, 0
    return ids, mask


def confidence(logits: np.ndarray) -> dict[str, float]:
    rows = logits.reshape(-1, logits.shape[-1])
    e = np.exp(rows - rows.max(1, keepdims=True))
    p = np.sort(e / e.sum(1, keepdims=True), 1)
    entropy = -(p * np.log(p)).sum(1)
    margin = p[:, -1] - p[:, -2]
    return {"entropy_mean": entropy.mean(), "entropy_max": entropy.max(), "top1_mean": p[:, -1].mean(),
            "top1_min": p[:, -1].min(), "margin_mean": margin.mean(), "margin_min": margin.min()}


def check(results: dict[str, Any], logits: Any, layer: np.ndarray, head: np.ndarray) -> None:
    """The tap's results are the float64 reference's on exactly ``layer`` (valid, hidden) and ``head`` (valid, vocab)."""
    m = results["moments"]
    assert m.count == layer.size
    assert m.mean == pytest.approx(layer.mean(), abs=1e-6) and m.std == pytest.approx(layer.std(), rel=1e-5)
    assert (results["minmax"].min, results["minmax"].max) == pytest.approx((layer.min(), layer.max()), rel=1e-6)
    pc = results["per_channel"]
    assert (pc.dim, pc.channels) == (2, HIDDEN)
    np.testing.assert_allclose(pc.mean, layer.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pc.std, layer.std(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pc.abs_max, np.abs(layer).max(0), rtol=1e-6)
    h = results["histogram"]
    assert h.population == layer.size
    assert list(h.counts) == np.histogram(layer, [-np.inf, *EDGES, np.inf])[0].tolist()
    assert (logits.rows, logits.classes) == head.shape
    for name, want in confidence(head).items():
        assert getattr(logits, name) == pytest.approx(want, abs=1e-5), name


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_changes_nothing_on_a_served_llama(make_server, llama, side: str) -> None:
    path, model = llama
    ids, mask = padded(side)
    ref = local(model, torch.from_numpy(ids), torch.from_numpy(mask))
    valid = mask.astype(bool)
    if side == "right":  # the valid positions are those of the sequences without padding
        alone = [local(model, torch.from_numpy(row[m])[None]) for row, m in zip(ids, valid)]
        for key in ("layer", "logits"):
            np.testing.assert_allclose(ref[key][valid], np.concatenate([a[key][0] for a in alone]), atol=2e-5)
    server = make_server(model=f"hf:{path}")
    with Client(f"127.0.0.1:{server.port}") as client:
        taps = [client.create_tap(LAYER, reducers=REDUCERS, ttl=60), client.create_tap("lm_head", reducers=["logits"], ttl=60),
                client.create_tap(LAYER, reducers=REDUCERS, ttl=60, keep_padding=True),
                client.create_tap("lm_head", reducers=["logits"], ttl=60, keep_padding=True)]
        assert [t.spec.keep_padding for t in taps] == [False, False, True, True]
        with client.subscribe([t.id for t in taps], timeout=60) as stream:
            assert wait_for(lambda: client.stats().subscribers == 1)
            client.infer(input_ids=ids, attention_mask=mask)
            got = {s.tap: s.results for s in (next(stream) for _ in taps)}
    check(got[taps[0].id], got[taps[1].id]["logits"], ref["layer"][valid], ref["logits"][valid])
    # Kept, the padded positions count: all 18 of them.
    check(got[taps[2].id], got[taps[3].id]["logits"], ref["layer"].reshape(-1, HIDDEN),
          ref["logits"].reshape(18, -1))


def test_a_per_channel_dim_on_the_token_axis_needs_keep_padding(make_server, llama) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}")
    with Client(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(InvalidArgument, match="keep_padding") as err:
            client.create_tap(LAYER, reducers=[{"per_channel": {"dim": 1}}])
        assert err.value.field == "spec.reducers[0].per_channel.dim"
        assert client.create_tap(LAYER, reducers=[{"per_channel": {"dim": 1}}], keep_padding=True).spec.keep_padding


def test_a_baseline_from_padded_traffic_equals_one_from_the_same_tokens_unpadded(make_server, llama) -> None:
    path, _model = llama
    rng = np.random.default_rng(11)
    batches = []
    for _ in range(3):  # two sequences, 5 and 3 tokens, the shorter right-padded
        ids = rng.integers(1, VOCAB, (2, 5))
        mask = np.ones_like(ids)
        mask[1, 3:], ids[1, 3:] = 0, 0
        batches.append((ids, mask))
    frozen = []
    for traffic in ("padded", "unpadded"):
        server = make_server(model=f"hf:{path}")
        with Client(f"127.0.0.1:{server.port}") as client:
            client.set_baseline(LAYER, passes=3 if traffic == "padded" else 6, window=2)
            for ids, mask in batches:
                if traffic == "padded":
                    client.infer(input_ids=ids, attention_mask=mask)
                else:
                    for row, m in zip(ids, mask.astype(bool)):
                        client.infer(input_ids=row[m][None])
            assert server.state.taps.flush(10)
            assert wait_for(lambda c=client: c.drift()[0].state == "ready")
        [phases] = server.state.drift._layers.values()
        [entry] = phases.values()
        frozen.append(entry.baseline)
    a, b = frozen
    assert a.count == b.count == 3 * 8 * HIDDEN  # the 8 valid tokens of each batch, nothing of the padding
    assert a.mean == pytest.approx(b.mean, abs=1e-6)
    assert a.m2 == pytest.approx(b.m2, rel=1e-5)
    assert (a.min, a.max) == pytest.approx((b.min, b.max), rel=1e-5)
    np.testing.assert_allclose(a.channel_mean, b.channel_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.channel_std, b.channel_std, rtol=1e-5, atol=1e-6)


def test_a_generate_prefill_leaves_each_prompts_padding_out(make_server, llama) -> None:
    """Two prompts of one request, left-padded to one length by the Generate loop: its inline tap and a durable
    prefill tap see the 7 prompt tokens, each as the prompt alone gives it; a tap that keeps padding sees 10."""
    path, model = llama
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    server = make_server(model=f"hf:{path}")
    moments = [tpb.ReducerSpec(kind=tpb.REDUCER_KIND_MOMENTS)]
    with Client(f"127.0.0.1:{server.port}") as client:
        durable = client.create_tap(LAYER, reducers=["moments"], phases=["prefill"], ttl=60)
        with client.subscribe([durable.id], timeout=60) as stream:
            assert wait_for(lambda: client.stats().subscribers == 1)
            stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
            req = ipb.GenerateRequest(prompts=[ipb.TokenIds(ids=p) for p in prompts], max_new_tokens=1, taps=[
                tpb.TapSpec(selector=LAYER, reducers=moments),
                tpb.TapSpec(selector=LAYER, reducers=moments, keep_padding=True)])
            inline = [s for r in stub.Generate(req, timeout=60) for s in r.summaries]
            whole = next(stream).results["moments"]
    alone = np.concatenate([local(model, torch.tensor([p]))["layer"][0] for p in prompts])
    assert alone.shape == (7, HIDDEN)
    mine, kept = sorted(inline, key=lambda s: s.results[0].moments.count)
    for got in (mine.results[0].moments, whole):
        assert got.count == alone.size
        assert got.mean == pytest.approx(alone.mean(), abs=1e-5) and got.std == pytest.approx(alone.std(), rel=1e-4)
    assert kept.results[0].moments.count == 10 * HIDDEN
