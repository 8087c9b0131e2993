"""Confidence drift on a served Hugging Face model: taps and baselines on per-token entropy (``derive``).

A tiny random-init Llama, saved with ``save_pretrained`` and served by
``hf:DIR``. The references are float64 numpy entropy (and top-1 probability)
of a local forward's logits. Making the head less confident in place (its
weights scaled down: a flatter softmax, higher entropy) must raise drift on
an entropy baseline, which stayed under its thresholds before.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

from support import hf_models
from support.e2e import wait_for

from layertap import Client, InvalidArgument, LayerDrift

pytestmark = pytest.mark.slow

VOCAB = hf_models.TINY["llama"][2]["vocab_size"]
SCORES = ("psi", "js", "wasserstein", "mean_shift")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return hf_models.save("llama", tmp_path_factory.mktemp("hf"))


def confidence(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Float64 per-token entropy and top-1 probability of a local forward's logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ids),
                       attention_mask=None if mask is None else torch.from_numpy(mask)).logits.double().numpy()
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    return -(p * np.log(p)).sum(-1), p.max(-1)


def test_derived_taps_on_lm_head_equal_numpy_per_token(make_server, llama) -> None:
    path, model = llama
    ids = np.random.default_rng(3).integers(1, VOCAB, (2, 5))
    entropy, top1 = confidence(model, ids)
    server = make_server(model=f"hf:{path}")
    with Client(f"127.0.0.1:{server.port}") as client:
        taps = [client.create_tap("lm_head", reducers=["moments", "minmax"], derive=d, ttl=60)
                for d in ("entropy", "top1_prob")]
        assert [t.spec.derive for t in taps] == ["entropy", "top1_prob"]
        with client.subscribe([t.id for t in taps], timeout=60) as stream:
            assert wait_for(lambda: client.stats().subscribers == 1)
            client.infer(input_ids=ids)
            got = {s.tap: s for s in (next(stream) for _ in taps)}
    for tap, want in zip(taps, (entropy, top1)):
        s = got[tap.id]
        m = s.results["moments"]
        assert m.count == 10  # one value per token, not the 2 * 5 * vocab logits
        assert m.mean == pytest.approx(want.mean(), rel=1e-5) and m.std == pytest.approx(want.std(), rel=1e-3)
        mm = s.results["minmax"]
        assert (mm.min, mm.max) == pytest.approx((want.min(), want.max()), rel=1e-5)


def test_derive_on_a_tensor_it_cannot_read_disables_the_tap_not_inference(make_server, llama) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}")
    ids = np.random.default_rng(4).integers(1, VOCAB, (2, 5))
    with Client(f"127.0.0.1:{server.port}") as client:
        # The embedding's input is the token ids: integers, no softmax.
        tap = client.create_tap("model.embed_tokens", point="input", reducers=["moments"], derive="entropy", ttl=60)
        assert client.infer(input_ids=ids)  # inference goes on
        assert server.state.taps.flush(10)
        [info] = [t for t in client.taps() if t.id == tap.id]
        assert info.disabled and "floating-point" in info.last_error, info
        with pytest.raises(InvalidArgument, match="derive"):
            client.create_tap("lm_head", derive="confidence")


def feed(server, client: Client, rng: np.random.Generator, passes: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(passes):
        client.infer(input_ids=rng.integers(1, VOCAB, (16, 32)))
    assert server.state.taps.flush(10), "tap pipeline did not drain"


def test_a_less_confident_head_drifts_on_its_entropy_baseline(make_server, llama) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}")
    rng = np.random.default_rng(5)
    with Client(f"127.0.0.1:{server.port}") as client:
        # Twenty passes cannot calibrate: given thresholds make both alarms fixed (the four scores decide).
        plain = client.set_baseline("lm_head", passes=20, window=10, thresholds={"psi": 0.2})
        info = client.set_baseline("lm_head", passes=20, window=10, derive="entropy", thresholds={"psi": 0.2})
        assert info.tap != plain.tap and info.tap.endswith("-entropy") and info.layers == ["lm_head"]

        def entry() -> LayerDrift:
            [d] = [d for d in client.drift("lm_head") if d.tap == info.tap]
            return d

        feed(server, client, rng, 20)
        assert entry().state == "ready" and entry().derive == "entropy"
        assert {d.tap: d.derive for d in client.drift()}[plain.tap] == ""
        feed(server, client, rng, 10)
        before = entry()
        assert before.window_passes == 10
        for m in SCORES:
            assert math.isfinite(getattr(before, m)) and getattr(before, m) < getattr(before.thresholds, m), before
        assert not before.drifted

        head = server.state.host.modules["lm_head"]
        with server.state.host.pass_lock(), torch.no_grad():
            head.weight.mul_(0.05)  # flatter softmax: every token's entropy goes up
        feed(server, client, rng, 10)
        after = entry()
    assert after.drifted, after
    assert after.mean_shift > after.thresholds.mean_shift and after.wasserstein > after.thresholds.wasserstein, after


def test_a_padded_batchs_entropy_baseline_counts_only_valid_tokens(make_server, llama) -> None:
    path, model = llama
    rng = np.random.default_rng(6)
    batches, valid = [], []
    for _ in range(3):  # three sequences of 6 tokens, the second with 2 right-padded
        ids = rng.integers(1, VOCAB, (3, 6))
        mask = np.ones_like(ids)
        mask[1, 4:], ids[1, 4:] = 0, 0
        batches.append((ids, mask))
        valid.append(confidence(model, ids, mask)[0][mask.astype(bool)])
    want = np.concatenate(valid)
    assert want.size == 3 * 16
    server = make_server(model=f"hf:{path}")
    with Client(f"127.0.0.1:{server.port}") as client:
        info = client.set_baseline("lm_head", passes=3, window=2, derive="entropy")
        for ids, mask in batches:
            client.infer(input_ids=ids, attention_mask=mask)
        assert server.state.taps.flush(10)
        assert wait_for(lambda: client.drift()[0].state == "ready")
    [entry] = server.state.drift._layers[(info.tap, "lm_head")].values()
    b = entry.baseline
    assert b.count == want.size  # the 16 valid tokens of each batch, nothing of the padding
    assert b.mean == pytest.approx(want.mean(), rel=1e-5)
    assert (b.min, b.max) == pytest.approx((want.min(), want.max()), rel=1e-5)
