"""Generate on a served Hugging Face model, against transformers' own ``generate``.

Tiny random-init Llama and GPT-2 models, saved with ``save_pretrained`` and
served by ``hf:DIR`` in process; the RPC is called through its generated stub.
Random-init models have small top-2 margins, so tokens are compared where the
reference's margin is above the float tolerance, and log-probabilities are
compared with a local forward's ``log_softmax`` at every step.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

from support import hf_models
from support.e2e import wait_for
from support.generation import local_generate, request, stub_of, tokens_of

from layertap.v1 import inference_pb2 as ipb
from layertap.v1 import tensor_pb2

pytestmark = pytest.mark.e2e

#: Logits closer than this may flip between two correct float orders of summation.
MARGIN = 1e-4
#: Room for long generations, and no end-of-sequence id: every run makes all its tokens.
LONG = {"max_position_embeddings": 1024, "eos_token_id": None}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return hf_models.save("llama", tmp_path_factory.mktemp("hf"), **LONG)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return hf_models.save("gpt2", tmp_path_factory.mktemp("hf"), n_positions=256, eos_token_id=None,
                          bos_token_id=None)


def reference(model: torch.nn.Module, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens, and the float64 log-softmax of each step's logits (local full forwards)."""
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                         pad_token_id=0)[0, len(prompt):].tolist()
    logprobs = []
    with torch.no_grad():
        for k in range(len(ids)):
            logits = model(torch.tensor([prompt + ids[:k]])).logits[0, -1].double()
            logprobs.append(torch.log_softmax(logits, -1))
    return ids, logprobs


def assert_same_greedy(got: list[ipb.GeneratedToken], ref_ids: list[int], ref_lp: list[torch.Tensor],
                       prompt_len: int) -> None:
    """Equal tokens up to a step whose reference top-2 margin is within float noise; equal log-probs to there."""
    for k, (token, want) in enumerate(zip(got, ref_ids)):
        top2 = torch.topk(ref_lp[k], 2).values
        if token.id != want:
            assert float(top2[0] - top2[1]) < MARGIN, f"step {k}: {token.id} != {want} with margin {top2}"
            return  # past a tie the sequences may differ for good
        assert token.position == prompt_len + k
        assert abs(token.logprob - float(ref_lp[k][want])) < 1e-4, (k, token.logprob, float(ref_lp[k][want]))
    assert len(got) == len(ref_ids)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_tokens_equal_transformers_generate(make_server, llama, gpt2, kind) -> None:
    path, model = llama if kind == "llama" else gpt2
    server = make_server(model=f"hf:{path}")
    prompt = hf_models.example_input(kind, batch=1, tokens=7)[0].tolist()
    responses = list(stub_of(server).Generate(request(prompt, max_new_tokens=12)))
    assert responses[0].started.request_id.startswith("gen-")
    assert list(responses[0].started.prompts[0].ids) == prompt
    steps = [r for r in responses if r.tokens]
    assert [r.phase for r in steps] == [1] + [2] * (len(steps) - 1)  # prefill, then decodes
    assert [r.step for r in steps] == list(range(len(steps)))
    ref_ids, ref_lp = reference(model, prompt, 12)
    assert_same_greedy(tokens_of(responses)[0], ref_ids, ref_lp, len(prompt))
    done = responses[-1].finished
    assert done.prompt_tokens == len(prompt) and done.generated_tokens == len(steps)
    assert done.time_to_first_token_seconds > 0
    assert list(done.finish_reasons) == [ipb.FINISH_REASON_LENGTH]


def test_ragged_batch_matches_single_requests(make_server, llama) -> None:
    path, model = llama
    server = make_server(model=f"hf:{path}")
    stub = stub_of(server)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23]]
    batched = tokens_of(list(stub.Generate(request(*prompts, max_new_tokens=8))), 3)
    for i, prompt in enumerate(prompts):
        alone = tokens_of(list(stub.Generate(request(prompt, max_new_tokens=8))))[0]
        ref_ids, ref_lp = reference(model, prompt, 8)
        assert_same_greedy(alone, ref_ids, ref_lp, len(prompt))
        assert_same_greedy(batched[i], ref_ids, ref_lp, len(prompt))


def test_concurrent_requests_join_the_running_batch(make_server, llama) -> None:
    """Requests arriving while others decode join at a step boundary (their prefill a pass of its own)."""
    path, model = llama
    server = make_server(model=f"hf:{path}")
    stub = stub_of(server)
    prompts = [[5 + i, 6, 7 + i, 8] for i in range(6)]
    results: dict[int, list[ipb.GenerateResponse]] = {}
    seen_together = []
    original = server.state.host.pass_context

    def spy(**kwargs: Any) -> Any:
        seen_together.append(len(kwargs.get("requests", ())))
        return original(**kwargs)

    server.state.host.pass_context = spy
    try:
        def run(i: int) -> None:
            results[i] = list(stub.Generate(request(prompts[i], max_new_tokens=24)))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.state.host.pass_context = original
    assert max(seen_together) >= 2, "no decode pass held two requests"
    for i, prompt in enumerate(prompts):
        ref_ids, ref_lp = reference(model, prompt, 24)
        assert_same_greedy(tokens_of(results[i])[0], ref_ids, ref_lp, len(prompt))


def test_sampling_with_a_seed_is_reproducible(make_server, llama) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}")
    stub = stub_of(server)
    req = request([5, 6, 7], max_new_tokens=16, do_sample=True, temperature=1.5, top_k=20, top_p=0.9,
                  seed=1234, has_seed=True)
    first = [t.id for t in tokens_of(list(stub.Generate(req)))[0]]
    again = [t.id for t in tokens_of(list(stub.Generate(req)))[0]]
    assert first == again
    other = request([5, 6, 7], max_new_tokens=16, do_sample=True, temperature=1.5, seed=99, has_seed=True)
    assert [t.id for t in tokens_of(list(stub.Generate(other)))[0]] != first
    # Sharing the batch with another request does not change a seeded request's draws.
    shared: list[list[int]] = []
    thread = threading.Thread(target=lambda: shared.append(
        [t.id for t in tokens_of(list(stub.Generate(req)))[0]]))
    thread.start()
    list(stub.Generate(request([9, 9, 9, 9], max_new_tokens=16)))
    thread.join(60)
    assert shared == [first]


def test_greedy_logprobs_are_those_of_a_top_k_draw(make_server, llama) -> None:
    """A top-k of 1 is greedy: sampling through the warpers must give the greedy tokens."""
    path, _model = llama
    server = make_server(model=f"hf:{path}")
    stub = stub_of(server)
    greedy = [t.id for t in tokens_of(list(stub.Generate(request([4, 5, 6], max_new_tokens=10))))[0]]
    top1 = request([4, 5, 6], max_new_tokens=10, do_sample=True, top_k=1, seed=7, has_seed=True)
    assert [t.id for t in tokens_of(list(stub.Generate(top1)))[0]] == greedy


def test_a_cancel_stops_the_generation_within_one_step(make_server, llama, monkeypatch) -> None:
    from layertap.server.generate import request as gen

    path, _model = llama
    at_cancel: dict[str, int] = {}
    requests: list[gen.GenerationRequest] = []
    original_cancel = gen.GenerationRequest.cancel

    def cancel(self: gen.GenerationRequest) -> None:
        at_cancel.setdefault(self.id, self.passes)
        requests.append(self)
        original_cancel(self)

    monkeypatch.setattr(gen.GenerationRequest, "cancel", cancel)
    server = make_server(model=f"hf:{path}", max_new_tokens=1000)
    stub = stub_of(server)
    call = stub.Generate(request([5, 6, 7], max_new_tokens=1000))
    got = 0
    for response in call:
        got += len(response.tokens)
        if got >= 3:
            break
    call.cancel()
    assert wait_for(lambda: requests and requests[0].done.is_set(), timeout=30)
    req = requests[0]
    assert req.passes - at_cancel[req.id] <= 1, (req.passes, at_cancel)
    assert req.passes < 1000
    assert wait_for(lambda: server.state.generator._batch is None, timeout=30)  # its cache is gone


def test_infer_runs_between_steps(make_server, llama) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}", max_new_tokens=1000)
    stub = stub_of(server)
    call = stub.Generate(request([5, 6, 7], max_new_tokens=1000))
    next(call), next(call)  # started, then the first step: the generation is running
    ids = tensor_pb2.Tensor(name="input_ids", dtype=tensor_pb2.DATA_TYPE_INT64, shape=[1, 4],
                            raw_data=torch.tensor([[1, 2, 3, 4]]).numpy().tobytes())
    for _ in range(3):
        stub.Infer(ipb.InferRequest(inputs=[ids]), timeout=30)
    assert server.state.generator._batch is not None, "the generation ended before the Infer calls returned"
    call.cancel()


def test_captures_at_every_step_equal_a_local_hook(make_server, llama) -> None:
    path, model = llama
    layer = hf_models.TINY["llama"][3]
    server = make_server(model=f"hf:{path}")
    prompt = [5, 6, 7, 8]
    responses = list(stub_of(server).Generate(request(prompt, max_new_tokens=5, capture=[layer])))
    steps = [r for r in responses if r.tokens]
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(layer).register_forward_hook(
        lambda _m, _a, out: seen.append((out[0] if isinstance(out, tuple) else out).detach().clone()))
    try:
        model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    finally:
        handle.remove()
    assert len(steps) == len(seen) == 5
    for step, local in zip(steps, seen):
        (cap,) = step.captures
        assert cap.layer == layer
        got = torch.frombuffer(bytearray(cap.tensor.raw_data), dtype=torch.float32).reshape(list(cap.tensor.shape))
        assert got.shape == local.shape  # (1, 4, H) for the prefill, then (1, 1, H)
        torch.testing.assert_close(got, local, rtol=1e-5, atol=1e-5)


def test_text_prompts_use_the_directory_tokenizer(make_server, tmp_path) -> None:
    path, model = hf_models.save("llama", tmp_path, **LONG)
    tok = hf_models.save_word_tokenizer(path, hf_models.TINY["llama"][2]["vocab_size"])
    server = make_server(model=f"hf:{path}")
    responses = list(stub_of(server).Generate(ipb.GenerateRequest(texts=["w5 w6 w7"], max_new_tokens=6)))
    prompt = list(responses[0].started.prompts[0].ids)
    assert prompt == tok("w5 w6 w7")["input_ids"]
    got = tokens_of(responses)[0]
    pieces = "".join(t.text for t in got)
    assert pieces.strip() == tok.decode([t.id for t in got]).strip()
    ref_ids, ref_lp = reference(model, prompt, 6)
    assert_same_greedy(got, ref_ids, ref_lp, len(prompt))


def test_stop_tokens_end_a_sequence(make_server, llama) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}")
    stub = stub_of(server)
    free = [t.id for t in tokens_of(list(stub.Generate(request([5, 6, 7], max_new_tokens=10))))[0]]
    stop = free[3]
    responses = list(stub.Generate(request([5, 6, 7], max_new_tokens=10, stop_token_ids=[stop])))
    got = [t.id for t in tokens_of(responses)[0]]
    assert got == free[:free.index(stop) + 1]
    assert list(responses[-1].finished.finish_reasons) == [ipb.FINISH_REASON_STOP]


@pytest.mark.parametrize(("req", "code", "field"), [
    (request([999]), grpc.StatusCode.INVALID_ARGUMENT, "prompts[0]"),
    (request([1] * 1024), grpc.StatusCode.INVALID_ARGUMENT, "prompts[0]"),
    (request([1], max_new_tokens=100_000), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    (request([1], do_sample=True, temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (request([1], do_sample=True, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (request([1], stop_token_ids=[-3]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids[0]"),
    (request([]), grpc.StatusCode.INVALID_ARGUMENT, "prompts[0]"),
    (ipb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompts"),
    (ipb.GenerateRequest(texts=["w1"]), grpc.StatusCode.FAILED_PRECONDITION, "texts"),
    (request([1], capture=["no.such.layer"]), grpc.StatusCode.NOT_FOUND, "capture[0]"),
])
def test_bad_requests_name_the_field(make_server, llama, req, code, field) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}")
    with pytest.raises(grpc.RpcError) as err:
        list(stub_of(server).Generate(req, timeout=30))
    assert err.value.code() == code
    assert err.value.details().startswith(field) or field in err.value.details(), err.value.details()
    assert server.state.generator._batch is None


def test_a_model_that_cannot_generate_is_refused(make_server) -> None:
    server = make_server()  # the demo CNN
    with pytest.raises(grpc.RpcError) as err:
        list(stub_of(server).Generate(request([1, 2]), timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot generate" in err.value.details()


def test_nan_logits_end_the_generation_with_a_clear_error(make_server, tmp_path) -> None:
    path, model = hf_models.save("llama", tmp_path, **LONG)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    model.save_pretrained(path)
    server = make_server(model=f"hf:{path}")
    with pytest.raises(grpc.RpcError) as err:
        list(stub_of(server).Generate(request([1, 2, 3], max_new_tokens=4), timeout=30))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "NaN or infinity" in err.value.details()
    assert wait_for(lambda: server.state.generator._batch is None, timeout=10)


def test_scopes_are_checked_as_subscribe_checks_them(make_server, llama, tmp_path) -> None:
    """Generate needs infer; its inline taps need tap, its captures capture."""
    import hashlib

    token = "tok-infer-only-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"inferer sha256:{hashlib.sha256(token.encode()).hexdigest()} infer\n")
    path, _model = llama
    server = make_server(model=f"hf:{path}", auth_tokens=str(tokens))
    stub = stub_of(server)
    auth = [("authorization", f"Bearer {token}")]
    assert tokens_of(list(stub.Generate(request([1, 2], max_new_tokens=2), metadata=auth, timeout=30)))[0]
    tap = ipb.GenerateRequest(prompts=[ipb.TokenIds(ids=[1, 2])])
    tap.taps.add(selector="model.layers.*").reducers.add(kind=1)
    for req, scope in ((tap, "tap"), (request([1, 2], capture=["model.layers.0"]), "capture")):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, metadata=auth, timeout=30))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"scope {scope!r}" in err.value.details()
    assert not server.state.taps.all_taps()  # nothing was left behind


def test_each_call_holds_a_stream_slot(make_server, llama) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}", max_streams=1, workers=4, max_new_tokens=1000)
    stub = stub_of(server)
    first = stub.Generate(request([5, 6, 7], max_new_tokens=1000))
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request([5, 6, 7], max_new_tokens=2), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-streams" in err.value.details()
    first.cancel()

    def admitted() -> bool:
        try:
            return bool(tokens_of(list(stub.Generate(request([5, 6, 7], max_new_tokens=2), timeout=30)))[0])
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return False

    assert wait_for(admitted, timeout=30)  # the cancelled call gave its slot back


def moments_tap(selector: str = "model.layers.*", phases: tuple[int, ...] = ()) -> Any:
    from layertap.v1 import telemetry_pb2 as tpb

    return tpb.TapSpec(selector=selector, reducers=[tpb.ReducerSpec(kind=tpb.REDUCER_KIND_MOMENTS)],
                       phases=list(phases))


def test_inline_taps_summarize_every_step_as_a_local_hook(make_server, llama) -> None:
    """layers x (1 prefill + (N - 1) decodes) summaries, each with its phase and position, each equal to a local hook."""
    path, model = llama
    server = make_server(model=f"hf:{path}")
    prompt, new = [5, 6, 7, 8, 9], 6
    req = request(prompt, max_new_tokens=new, taps=[moments_tap()])
    responses = list(stub_of(server).Generate(req, timeout=60))
    request_id = responses[0].started.request_id
    summaries = [s for r in responses for s in r.summaries]
    layers = [f"model.layers.{i}" for i in range(hf_models.TINY["llama"][2]["num_hidden_layers"])]
    assert len(summaries) == len(layers) * new  # one prefill and new - 1 decodes: N forwards for N tokens
    local = local_generate(model, prompt, new, layers)[2]
    for s in summaries:
        assert list(s.request_ids) == [request_id]
        assert s.has_position
        k = s.position - len(prompt)  # the k-th new token's pass
        assert s.phase == (1 if k == 0 else 2)
        ref = local[s.layer][k]
        assert s.results[0].moments.count == ref.numel()
        assert abs(s.results[0].moments.mean - float(ref.mean())) < 1e-5
        assert abs(s.results[0].moments.std - float(ref.std(unbiased=False))) < 1e-5
    assert sorted({s.position for s in summaries}) == list(range(len(prompt), len(prompt) + new))


def test_a_phase_filter_keeps_decode_steps_only(make_server, llama) -> None:
    path, _model = llama
    server = make_server(model=f"hf:{path}")
    req = request([5, 6, 7], max_new_tokens=4, taps=[moments_tap("model.layers.0", phases=(2,))])
    summaries = [s for r in stub_of(server).Generate(req, timeout=60) for s in r.summaries]
    assert [s.phase for s in summaries] == [2, 2, 2]
    assert [s.position for s in summaries] == [4, 5, 6]


def test_a_request_tap_sees_only_its_rows_in_a_batch(make_server, llama) -> None:
    """Another request's rows share the decode passes: the tap sees its own row only, never the batch."""
    path, model = llama
    server = make_server(model=f"hf:{path}")
    stub = stub_of(server)
    mine = [5, 6, 7, 8, 9, 10]
    other = stub.Generate(request([3, 4], max_new_tokens=500), timeout=60)
    next(other), next(other)  # it is decoding
    responses = list(stub.Generate(request(mine, max_new_tokens=4, taps=[moments_tap("model.layers.1")]), timeout=60))
    # Its finished row leaves the batch at the next decode step, which a busy machine may not have run yet.
    assert wait_for(lambda: (batch := server.state.generator._batch) is not None and len(batch.rows) == 1)
    other.cancel()
    summaries = [s for r in responses for s in r.summaries]
    local = local_generate(model, mine, 4, ["model.layers.1"])[2]["model.layers.1"]
    assert len(summaries) == 4
    for s, ref in zip(summaries, local):
        assert s.results[0].moments.count == ref.numel()  # (1, 1, H) on a decode pass of two rows
        assert abs(s.results[0].moments.mean - float(ref.mean())) < 1e-5
        assert list(s.request_ids) == [responses[0].started.request_id]


def test_the_end_of_sequence_id_stops_a_sequence(make_server, tmp_path) -> None:
    path, model = hf_models.save("llama", tmp_path)  # eos_token_id 2, as LlamaConfig says
    server = make_server(model=f"hf:{path}")
    prompt = [5, 6, 7, 8, 9]
    responses = list(stub_of(server).Generate(request(prompt, max_new_tokens=10), timeout=60))
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert ref[-1] == 2 and len(ref) < 10  # transformers stops at it too
    assert [t.id for t in tokens_of(responses)[0]] == ref
    assert list(responses[-1].finished.finish_reasons) == [ipb.FINISH_REASON_STOP]
