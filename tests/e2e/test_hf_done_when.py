"""Issue 23's "Done when": a decoder-only architecture no other test uses, served by ``--model hf:DIR``.

A tiny random-init Qwen2 (tied embeddings, grouped-query attention, biased
q/k/v projections), saved with ``save_pretrained`` into a temporary directory
and served by a real ``layertap serve --model hf:DIR`` subprocess; every
reference is the same directory loaded locally with transformers'
``from_pretrained``. Nothing downloads. Under ``CI=true`` these tests run (a
missing transformers fails them); elsewhere they skip without transformers.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

from prometheus_client.parser import text_string_to_metric_families
from support.e2e import first_per_layer, wait_for
from support.serve import read_startup

from layertap import Client

pytestmark = pytest.mark.e2e

ARCH = "Qwen2ForCausalLM"
VOCAB = 80
LAYERS = 3
HIDDEN = 16
CONFIG = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 32, "num_hidden_layers": LAYERS,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
          "tie_word_embeddings": True}
DECODER_LAYERS = [f"model.layers.{i}" for i in range(LAYERS)]
ATTN = "model.layers.0.self_attn"
SERVE = [sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--device", "cpu", "--no-compile"]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen2, ``save_pretrained`` into a fresh directory."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG)).eval()
    out = tmp_path_factory.mktemp("hf") / "qwen2"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def local(qwen2_dir: Path) -> torch.nn.Module:
    """The saved weights, loaded here with transformers' own ``from_pretrained``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(qwen2_dir).eval()
    assert type(model).__name__ == ARCH
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    return model


@contextmanager
def serve(model_dir: Path, *extra: str) -> Iterator[tuple[str, int | None, str]]:
    """A ``layertap serve --model hf:DIR``: ``(address, metrics port, the hint line)``; stopped afterwards."""
    proc = subprocess.Popen([*SERVE, "--model", f"hf:{model_dir}", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        lines: list[str] = []
        port, metrics_port = read_startup(proc.stdout, lines)
        if port < 0:
            proc.wait(30)
            pytest.fail(f"serve did not start: {''.join(lines)}\n{proc.stderr.read()[-3000:]}")
        assert lines[-1].startswith("layertap: try"), lines
        # Keep draining both pipes so the server never blocks on a full one.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield f"127.0.0.1:{port}", metrics_port, lines[-1]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(qwen2_dir: Path) -> Iterator[tuple[str, int]]:
    """One served Qwen2 with ``/metrics``, shared by the tests that only add traffic and taps."""
    with serve(qwen2_dir, "--metrics-port", "0") as (address, metrics_port, _hint):
        assert metrics_port is not None
        yield address, metrics_port


@pytest.fixture
def client(server: tuple[str, int]) -> Iterator[Client]:
    with Client(server[0]) as c:
        yield c


def token_batch(batch: int = 2, tokens: int = 6, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, tokens)).astype(np.int64)


def padded_batch() -> tuple[np.ndarray, np.ndarray]:
    """Token ids and an attention mask whose row 0 is left-padded by two."""
    ids = token_batch()
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 0  # the pad token
    return ids, mask


def run_local(model: torch.nn.Module, **inputs: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).logits


def scrape(metrics_port: int) -> list:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


# -- 1. infer with input_ids and attention_mask ---------------------------------------------------------------


def test_a_padded_batch_with_its_mask_equals_the_local_model(client: Client, local: torch.nn.Module) -> None:
    meta = client.metadata()
    assert meta.source == "hf"
    assert [(s.name, s.dtype, list(s.shape)) for s in meta.inputs][:2] == [
        ("input_ids", "int64", [-1, -1]), ("attention_mask", "int64", [-1, -1])]
    ids, mask = padded_batch()
    want = run_local(local, input_ids=ids, attention_mask=mask).numpy()
    got = client.infer(input_ids=ids, attention_mask=mask)
    assert isinstance(got, dict) and got["logits"].shape == (2, 6, VOCAB)
    np.testing.assert_allclose(got["logits"], want, rtol=1e-5, atol=1e-5)
    # The mask mattered: the local run without it is further off than the served one.
    unmasked = run_local(local, input_ids=ids).numpy()
    mask_effect = np.abs(unmasked - want).max()
    assert mask_effect > 1e-3, mask_effect
    assert np.abs(got["logits"] - want).max() < mask_effect / 10


# -- 2. a keyword-argument input tap on an attention module ---------------------------------------------------


def test_a_keyword_input_tap_on_attention_names_hidden_states(client: Client, local: torch.nn.Module) -> None:
    ids = token_batch(batch=3, tokens=5, seed=2)
    mask = np.ones_like(ids)  # no padding: the moments do not depend on whether padding is left out
    seen: dict[str, tuple] = {}
    handle = local.get_submodule(ATTN).register_forward_pre_hook(
        lambda _m, args, kwargs: seen.__setitem__("call", (args, kwargs)), with_kwargs=True)
    try:
        run_local(local, input_ids=ids, attention_mask=mask)
    finally:
        handle.remove()
    args, kwargs = seen["call"]
    assert args == () and isinstance(kwargs["hidden_states"], torch.Tensor)  # Hugging Face passes keywords only
    # Every tensor keyword, by its path (a (cos, sin) pair is two); the cache and flags are no tensors.
    want: dict[str, np.ndarray] = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            want[key] = value.double().numpy()
        elif isinstance(value, tuple):
            want.update({f"{key}.{i}": v.double().numpy() for i, v in enumerate(value) if isinstance(v, torch.Tensor)})
    assert list(want)[0] == "hidden_states" and want["hidden_states"].shape == (3, 5, HIDDEN)
    with client.watch(ATTN, point="input", reducers=["moments"], timeout=60) as stream:
        assert wait_for(lambda: any(ATTN in t.layers for t in client.taps()), timeout=10)
        client.infer(input_ids=ids, attention_mask=mask)
        summaries = []
        for s in stream:  # one summary per tensor argument of the pass
            summaries.append(s)
            if len(summaries) == len(want):
                break
    assert [(s.output_index, s.output_key) for s in summaries] == list(enumerate(want))
    for s in summaries:
        assert (s.layer, s.point) == (ATTN, "input")
        ref, m = want[s.output_key], s.results["moments"]
        assert m.count == ref.size, s.output_key
        np.testing.assert_allclose(m.mean, ref.mean(), rtol=1e-5, atol=1e-6, err_msg=s.output_key)
        np.testing.assert_allclose(m.std, ref.std(), rtol=1e-4, atol=1e-6, err_msg=s.output_key)


# -- 3. a capture by glob of every decoder layer --------------------------------------------------------------


def test_a_glob_capture_of_every_decoder_layer_equals_local_forward_hooks(client: Client,
                                                                          local: torch.nn.Module) -> None:
    ids, mask = padded_batch()
    seen: dict[str, torch.Tensor] = {}
    handles = [local.get_submodule(name).register_forward_hook(
        lambda _m, _a, out, name=name: seen.__setitem__(name, out[0] if isinstance(out, tuple) else out))
        for name in DECODER_LAYERS]
    try:
        run_local(local, input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    got = client.capture("model.layers.*", input={"input_ids": ids, "attention_mask": mask})
    assert isinstance(got, dict) and list(got) == DECODER_LAYERS  # one tensor per layer, in model order
    for name in DECODER_LAYERS:
        assert isinstance(got[name], np.ndarray) and got[name].shape == (2, 6, HIDDEN), (name, type(got[name]))
        np.testing.assert_allclose(got[name], seen[name].numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


# -- 4. watch -------------------------------------------------------------------------------------------------


def test_watch_yields_summaries_of_every_decoder_layer_while_traffic_runs(client: Client, server) -> None:
    stop = threading.Event()

    def traffic() -> None:
        with Client(server[0]) as feeder:
            while not stop.is_set():
                feeder.infer(input_ids=token_batch(seed=3))

    with client.watch("model.layers.*", timeout=60) as stream:
        feeder = threading.Thread(target=traffic, daemon=True)
        feeder.start()
        try:
            got = first_per_layer(stream, LAYERS)
        finally:
            stop.set()
            feeder.join(30)
    assert sorted(got) == DECODER_LAYERS
    for s in got.values():
        assert s.point == "output" and s.results["moments"].count == 2 * 6 * HIDDEN
        assert np.isfinite(s.results["moments"].mean) and s.results["nonfinite"].nan_count == 0


# -- 5. a baseline and drift ----------------------------------------------------------------------------------


def test_a_baseline_becomes_ready_and_drift_scores_the_layers(client: Client) -> None:
    info = client.set_baseline("model.layers.*", passes=4, window=2)
    assert sorted(info.layers) == DECODER_LAYERS
    rng = np.random.default_rng(4)

    def feed(n: int) -> None:
        for _ in range(n):
            client.infer(input_ids=rng.integers(0, VOCAB, (2, 6)))

    feed(4)
    assert wait_for(lambda: [d.state for d in client.drift("model.layers.*")] == ["ready"] * LAYERS, timeout=30), \
        client.drift()
    feed(2)
    assert wait_for(lambda: all(d.window_passes == 2 for d in client.drift("model.layers.*")), timeout=30), \
        client.drift()
    drift = client.drift("model.layers.*")
    assert sorted(d.layer for d in drift) == DECODER_LAYERS
    for d in drift:
        assert d.state == "ready" and d.baseline_passes == 4, d
        assert all(np.isfinite(v) for v in (d.psi, d.js, d.wasserstein, d.mean_shift)), d


# -- 6. /metrics ----------------------------------------------------------------------------------------------


def test_metrics_has_the_tapped_layers_series(client: Client, server, local: torch.nn.Module) -> None:
    _address, metrics_port = server
    ids = token_batch(seed=5)
    seen: dict[str, np.ndarray] = {}
    handles = [local.get_submodule(name).register_forward_hook(
        lambda _m, _a, out, name=name: seen.__setitem__(
            name, (out[0] if isinstance(out, tuple) else out).double().numpy()))
        for name in DECODER_LAYERS]
    try:
        run_local(local, input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    with client.tap("model.layers.*", reducers=["moments"], name="done-when", ttl=120) as tap:
        assert wait_for(lambda: any(t.id == tap.id for t in client.taps()), timeout=10)

        def means() -> dict[str, float]:
            client.infer(input_ids=ids)  # the same input each time: the latest summary's mean is known
            return {s.labels["layer"]: s.value for s in scrape(metrics_port)
                    if s.name == "layertap_activation_mean" and s.labels.get("tap") == tap.id}

        assert wait_for(lambda: sorted(means()) == DECODER_LAYERS, timeout=30), means()
        got = means()
    for name in DECODER_LAYERS:
        assert got[name] == pytest.approx(seen[name].mean(), rel=1e-5, abs=1e-6), name


# -- 7. serve --smoke -----------------------------------------------------------------------------------------


def test_serve_smoke_passes(qwen2_dir: Path) -> None:
    done = subprocess.run([*SERVE, "--no-metrics", "--smoke", "--model", f"hf:{qwen2_dir}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layertap: captured " in done.stdout, done.stdout
    assert f"infer output (2, 2, {VOCAB})" in done.stdout, done.stdout


# -- 8. the start-up hint on a fresh server -------------------------------------------------------------------


def test_the_startup_hint_succeeds_on_a_fresh_server(qwen2_dir: Path, tmp_path: Path) -> None:
    with serve(qwen2_dir, "--no-metrics") as (address, _metrics_port, hint):
        command = shlex.split(hint.split("`")[1])
        assert command[:3] == ["layertap", "capture", address] and "--random-input" in command, hint
        assert command[command.index("--vocab-size") + 1] == str(VOCAB), hint
        # Runs as printed: -o is relative, so the file lands in tmp_path.
        done = subprocess.run([sys.executable, "-m", "layertap.cli", *command[1:]], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    array = np.load(tmp_path / command[command.index("-o") + 1])
    assert array.size > 0 and np.isfinite(array).all()
