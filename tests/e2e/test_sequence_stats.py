"""Sequence-aware statistics on a served Hugging Face model: the feature axis (and the logits reducer).

A tiny random-init Llama, saved with ``save_pretrained`` and served by ``hf:DIR``;
every reference is numpy on a local forward hook's tensor.
"""

from __future__ import annotations

import importlib.util
import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

from support import hf_models
from support.e2e import wait_for

from layertap import Client

pytestmark = pytest.mark.e2e

LAYER = hf_models.TINY["llama"][3]  # model.layers.0: (batch, tokens, hidden)
HIDDEN = hf_models.TINY["llama"][2]["hidden_size"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return hf_models.save("llama", tmp_path_factory.mktemp("hf"))


def local_output(model: torch.nn.Module, layer: str, x: torch.Tensor) -> np.ndarray:
    """A local forward hook's view of ``layer``'s (first) output, as float64."""
    seen: list[torch.Tensor] = []

    def hook(_module: torch.nn.Module, _args: object, out: object) -> None:
        seen.append(out[0] if isinstance(out, tuple) else out)  # type: ignore[arg-type]

    handle = model.get_submodule(layer).register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return seen[0].double().numpy()


def one_summary(client: Client, server, layer: str, reducers: list, x: np.ndarray):  # type: ignore[no-untyped-def]
    with client.watch(layer, reducers=reducers, timeout=60) as stream:
        assert wait_for(lambda: client.stats().active_hooks == 1)
        client.infer(x)
        return next(iter(stream))


def test_per_channel_on_a_token_model_is_per_hidden_unit(make_server, llama) -> None:
    path, model = llama
    x = hf_models.example_input("llama", batch=3, tokens=6)
    ref = local_output(model, LAYER, x)
    assert ref.shape == (3, 6, HIDDEN)
    server = make_server(model=f"hf:{path}")
    with Client(f"127.0.0.1:{server.port}") as client:
        s = one_summary(client, server, LAYER, ["per_channel"], x.numpy())
        pc = s.results["per_channel"]
        assert pc.dim == 2 and pc.channels == HIDDEN
        np.testing.assert_allclose(pc.mean, ref.mean(axis=(0, 1)), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pc.std, ref.std(axis=(0, 1)), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pc.abs_max, np.abs(ref).max(axis=(0, 1)), rtol=1e-6, atol=1e-7)
        # An explicit dim still wins: 1 is the token position, of a tap that keeps padding (see test_padding).
        with client.watch(LAYER, reducers=[{"per_channel": {"dim": 1}}], keep_padding=True, timeout=60) as stream:
            assert wait_for(lambda: client.stats().active_hooks == 1)
            client.infer(x.numpy())
            s = next(iter(stream))
        assert s.results["per_channel"].channels == 6
        np.testing.assert_allclose(s.results["per_channel"].mean, ref.mean(axis=(0, 2)), rtol=1e-5, atol=1e-6)


def test_a_baseline_on_a_token_model_scores_per_hidden_unit(make_server, llama) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}")
    rng = np.random.default_rng(0)
    vocab = hf_models.TINY["llama"][2]["vocab_size"]
    with Client(f"127.0.0.1:{server.port}") as client:
        info = client.set_baseline(LAYER, passes=4, window=2)
        assert info.layers == [LAYER]
        def feed(n: int) -> None:
            for _ in range(n):
                client.infer(rng.integers(0, vocab, (2, 5)))
            assert server.state.taps.flush(10)

        feed(4)
        assert client.drift()[0].state == "ready"
        feed(2)
        [d] = client.drift()
        assert d.state == "ready" and d.window_passes == 2, d
        # Per-channel means were collected over the hidden units and are scored.
        assert d.channel_drift_fraction is not None, d
    [phases] = server.state.drift._layers.values()
    entry = phases["forward"]  # Infer passes: plain forwards
    assert entry.baseline is not None and entry.baseline.channel_mean is not None
    assert entry.baseline.channel_mean.shape == (HIDDEN,)  # not the 5 token positions


def confidence(logits: np.ndarray) -> dict[str, float]:
    """Per-row softmax entropy, top-1 probability and margin in float64; their mean and worst."""
    rows = logits.astype(np.float64).reshape(-1, logits.shape[-1])
    e = np.exp(rows - rows.max(1, keepdims=True))
    p = np.sort(e / e.sum(1, keepdims=True), 1)
    entropy = -(p * np.log(p)).sum(1)
    margin = p[:, -1] - p[:, -2]
    return {"entropy_mean": entropy.mean(), "entropy_max": entropy.max(), "top1_mean": p[:, -1].mean(),
            "top1_min": p[:, -1].min(), "margin_mean": margin.mean(), "margin_min": margin.min()}


def test_logits_of_an_lm_head_in_the_summary_and_on_metrics(make_server, llama) -> None:
    path, model = llama
    x = hf_models.example_input("llama", batch=2, tokens=7)
    with torch.no_grad():
        ref_logits = model(x).logits.numpy()
    assert ref_logits.shape == (2, 7, hf_models.TINY["llama"][2]["vocab_size"])
    ref = confidence(ref_logits)
    server = make_server(model=f"hf:{path}", metrics_port=0)
    with Client(f"127.0.0.1:{server.port}") as client, \
            client.tap("lm_head", reducers=["logits"], ttl=60) as tap, tap.summaries(timeout=60) as stream:
        assert wait_for(lambda: client.stats().active_hooks == 1)
        client.infer(x.numpy())
        s = next(iter(stream))
        lg = s.results["logits"]
        assert (lg.rows, lg.classes) == (14, ref_logits.shape[-1])
        for name, want in ref.items():
            assert getattr(lg, name) == pytest.approx(want, abs=1e-5), name
        assert server.state.taps.flush(10)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    samples = {(m.name, sm.labels["stat"]): sm for m in text_string_to_metric_families(text)
               if m.name.startswith("layertap_logits_") for sm in m.samples}
    assert {m for m, _ in samples} == {"layertap_logits_entropy_nats", "layertap_logits_top1_probability",
                                       "layertap_logits_margin"}
    for (family, stat), field in {("layertap_logits_entropy_nats", "mean"): "entropy_mean",
                                  ("layertap_logits_entropy_nats", "max"): "entropy_max",
                                  ("layertap_logits_top1_probability", "mean"): "top1_mean",
                                  ("layertap_logits_top1_probability", "min"): "top1_min",
                                  ("layertap_logits_margin", "mean"): "margin_mean",
                                  ("layertap_logits_margin", "min"): "margin_min"}.items():
        sample = samples[(family, stat)]
        assert sample.labels["layer"] == "lm_head" and sample.labels["point"] == "output"
        assert sample.value == pytest.approx(ref[field], abs=1e-5), (family, stat)
