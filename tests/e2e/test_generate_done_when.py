"""Issue 24's "Done when", checked end to end.

A decoder-only model the check builds itself (a tiny random-init Mistral, an
architecture no other test serves), saved with ``save_pretrained`` and
served through ``hf:DIR`` with metrics on, driven by the real client:

- greedy tokens equal transformers' own, streamed as they come;
- per-token summaries of its decoder layers carry phase and position, each
  equal to a local forward hook on transformers' ``generate``;
- ``/metrics`` shows decode-phase series, as a real Prometheus scrapes them;
- a cancel frees the model within one step.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

from support.e2e import wait_for
from support.generation import local_generate
from support.prom import PrometheusServer, prometheus_binary

import layertap

pytestmark = pytest.mark.e2e

LAYERS = ["model.layers.0", "model.layers.1", "model.layers.2"]
MARGIN = 1e-4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    import transformers

    torch.manual_seed(3)
    config = transformers.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        sliding_window=None, eos_token_id=None, bos_token_id=None)
    model = transformers.MistralForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("hf") / "mistral"
    model.save_pretrained(out)
    return out, model


def test_generation_done_when(make_server, mistral, tmp_path) -> None:
    prometheus_binary()  # CI installs Debian's prometheus; skips only where it is missing
    path, model = mistral
    server = make_server(model=f"hf:{path}", metrics_port=0, max_new_tokens=2000)
    prompt, new = [11, 12, 13, 14, 15, 16, 17], 12
    ref_ids, ref_lp, local = local_generate(model, prompt, new, LAYERS)
    with layertap.Client(f"127.0.0.1:{server.port}") as client:
        # A durable tap feeds /metrics; the call's inline tap streams its own summaries.
        durable = client.create_tap("model.layers.*", reducers=["moments"], ttl=600)
        g = client.generate(prompt, max_new_tokens=new, taps=["model.layers.*"])
        steps = list(g)
        result = g.result()

        # Greedy tokens equal transformers' own, each log-prob its local log-softmax.
        tokens = [t for s in steps for t in s.tokens]
        assert [t.position for t in tokens] == list(range(len(prompt), len(prompt) + new))
        for k, (t, want) in enumerate(zip(tokens, ref_ids)):
            top2 = torch.topk(ref_lp[k], 2).values
            if t.id != want:
                assert float(top2[0] - top2[1]) < MARGIN, (k, t.id, want)
                break
            assert abs(t.logprob - float(ref_lp[k][want])) < 1e-4
        else:
            assert result.sequences == [ref_ids]

        # Per-token summaries of every decoder layer: phase, position, and a local hook's statistics.
        summaries = [s for step in steps for s in step.summaries]
        assert len(summaries) == len(LAYERS) * new
        for s in summaries:
            k = s.position - len(prompt)
            assert s.phase == ("prefill" if k == 0 else "decode") and s.request_ids == (g.request_id,)
            ref = local[s.layer][k]
            m = s.results["moments"]
            assert m.count == ref.numel()
            assert abs(m.mean - float(ref.mean())) < 1e-5 and abs(m.std - float(ref.std(unbiased=False))) < 1e-5

        # /metrics: decode-phase series of the durable tap, as text and through a real Prometheus.
        query = (f'layertap_activation_mean{{tap="{durable.id}",layer="model.layers.0",phase="decode"}}')
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        assert wait_for(lambda: 'phase="decode"' in urllib.request.urlopen(url, timeout=10).read().decode(),
                        timeout=30)
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'phase="prefill"' in text and f'layertap_generate_tokens_total{{model="mistral"}} {float(new)}' in text
        with PrometheusServer(tmp_path / "prom", f"127.0.0.1:{server.metrics_port}") as prom:
            prom.wait_for(prom.targets_up, what="the first successful scrape")
            rows = prom.wait_for(lambda: prom.query(query), what="a decode-phase series")
            assert rows[0]["metric"]["phase"] == "decode"

        # A cancel frees the model within one step of the server hearing of it.
        from layertap.server.generate import request as gen

        heard: list[tuple[gen.GenerationRequest, int]] = []
        original = gen.GenerationRequest.cancel

        def cancel(self: gen.GenerationRequest) -> None:
            heard.append((self, self.passes))
            original(self)

        gen.GenerationRequest.cancel = cancel  # type: ignore[method-assign]
        try:
            # Streamed as they come: the first token reaches the client while the decode passes are held back.
            go = threading.Event()
            host = server.state.host
            gate = host.module.get_submodule(LAYERS[0]).register_forward_pre_hook(
                lambda *_: None if host._current is None or host._current.phase != 2 else go.wait(30))
            try:
                long = client.generate(prompt, max_new_tokens=1500)
                first = next(step for step in long if step.tokens)
                assert first.phase == "prefill" and first.tokens[0].position == len(prompt)
                # Its decode passes wait at the gate: the generation is still running, its token already here.
                assert wait_for(lambda: server.state.generator._batch is not None, timeout=10) and not go.is_set()
            finally:
                go.set()
                gate.remove()
            long.cancel()
            assert wait_for(lambda: heard and heard[0][0].done.is_set(), timeout=30)
        finally:
            gen.GenerationRequest.cancel = original  # type: ignore[method-assign]
        request, at_cancel = heard[0]
        assert request.passes - at_cancel <= 1 and request.passes < 1500
        assert wait_for(lambda: server.state.generator._batch is None, timeout=30)
