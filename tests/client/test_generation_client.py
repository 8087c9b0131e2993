"""Client.generate: the request it builds, the Generate stream it reads, and ``layertap generate``.

Responses are built by hand; the stream tests run them through a scripted
gRPC server, so error translation and cancellation are the real ones.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.any_pb2 import Any as Any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

import layertap
from layertap import FailedPrecondition, InvalidArgument, LayertapError, ProtocolError, TapSpec
from layertap import _convert as convert
from layertap import _generate as gen
from layertap._taps import tap_spec
from layertap.cli import main
from layertap.v1 import inference_pb2, telemetry_pb2, tensor_pb2

pytestmark = pytest.mark.unit

PHASE = telemetry_pb2.Phase
FINISH = inference_pb2.FinishReason


# --------------------------------------------------------------------------- the request


@pytest.mark.parametrize(("prompt", "ids", "texts"), [
    ("Hello", [], ["Hello"]),
    ([5, 6, 7], [[5, 6, 7]], []),
    ((5, np.int64(6)), [[5, 6]], []),
    ([[1, 2, 3], [4]], [[1, 2, 3], [4]], []),  # ragged
    (["a", "b"], [], ["a", "b"]),
    (np.array([1, 2]), [[1, 2]], []),
    (np.array([[1, 2], [3, 4]], dtype=np.int32), [[1, 2], [3, 4]], []),
    ([np.array([1, 2]), [3]], [[1, 2], [3]], []),
])
def test_prompt_forms(prompt: Any, ids: list[list[int]], texts: list[str]) -> None:
    req = gen.generate_request(prompt)
    assert [list(p.ids) for p in req.prompts] == ids and list(req.texts) == texts


@pytest.mark.parametrize(("prompt", "match"), [
    ([], "prompt is empty"),
    ([[1, 2], []], r"prompt\[1\] is empty"),
    (["a", [1]], "mixes texts"),
    ([1, [2]], "mixes"),
    ([1.5, 2.0], "expected a sequence of token ids"),
    ([[1, 2.5]], "token ids are integers"),
    ([True, False], "expected a sequence"),
    (7, "expected a text"),
    (np.zeros((1, 2, 2), dtype=np.int64), "token ids are integers"),
])
def test_bad_prompts_are_refused_before_the_call(prompt: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        gen.generate_request(prompt)


def test_request_fields_and_defaults() -> None:
    req = gen.generate_request([1, 2])
    assert req.max_new_tokens == 16 and not req.do_sample and not req.has_seed
    assert (req.temperature, req.top_k, req.top_p) == (0.0, 0, 0.0)  # the server's defaults
    assert not req.taps and not req.capture and req.capture_dtype == tensor_pb2.DATA_TYPE_UNSPECIFIED
    req = gen.generate_request([1, 2], max_new_tokens=5, do_sample=True, temperature=0.7, top_k=40, top_p=0.9,
                               seed=0, stop_token_ids=np.array([2, 3]), capture="model.layers.*",
                               capture_dtype="bf16")
    assert (req.max_new_tokens, req.do_sample, req.top_k, req.seed, req.has_seed) == (5, True, 40, 0, True)
    assert req.temperature == pytest.approx(0.7) and req.top_p == pytest.approx(0.9)
    assert list(req.stop_token_ids) == [2, 3]
    assert list(req.capture) == ["model.layers.*"] and req.capture_dtype == tensor_pb2.DATA_TYPE_BFLOAT16
    assert gen.generate_request([1], seed=2**64 - 1, top_k=0).seed == 2**64 - 1


@pytest.mark.parametrize(("options", "match"), [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"temperature": 0.0}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"capture": [""]}, "capture"),
    ({"capture_dtype": "int8"}, "float16"),
    ({"taps": ["layer1", TapSpec("layer2", reducers=())]}, "at least one reducer"),
    ({"taps": TapSpec("x", phases=("warmup",))}, "unknown phase"),
])
def test_values_the_wire_cannot_carry_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        gen.generate_request([1, 2], **options)


def test_taps_are_built_as_a_watch_builds_its_stream_taps() -> None:
    spec = TapSpec("model.layers.*", reducers=("moments",), phases=("decode",))
    req = gen.generate_request("hi", taps=["model.norm", spec])
    watched = convert.subscribe_request(stream_taps=[tap_spec("model.norm", {}), spec]).stream_taps
    assert list(req.taps) == list(watched)
    assert list(req.taps[1].phases) == [PHASE.PHASE_DECODE]
    assert gen.generate_request("hi", taps="model.norm").taps[0].selector == "model.norm"  # one str is one tap


def test_tap_spec_phases_round_trip() -> None:
    for phases in [(), ("prefill",), ("decode", "")]:
        spec = TapSpec("layer1", phases=phases)
        assert convert.tap_spec_from_proto(convert.tap_spec_to_proto(spec)) == spec
    assert list(convert.tap_spec_to_proto(TapSpec("x", phases="decode")).phases) == [PHASE.PHASE_DECODE]  # type: ignore[arg-type]
    assert tap_spec("x", {"phases": "prefill"}).phases == ("prefill",)
    assert tap_spec("x", {"phases": ["prefill", "decode"]}).phases == ("prefill", "decode")


# --------------------------------------------------------------------------- responses


def _started(prompts: Sequence[Sequence[int]], request_id: str = "gen-1", tap_ids: Sequence[str] = ()) -> Any:
    return inference_pb2.GenerateResponse(started=inference_pb2.GenerationStarted(
        request_id=request_id, tap_ids=list(tap_ids), prompts=[inference_pb2.TokenIds(ids=p) for p in prompts]))


def _summary(layer: str, mean: float, phase: int, position: int | None, pass_index: int) -> Any:
    s = telemetry_pb2.Summary(tap="t1", layer=layer, pass_index=pass_index, phase=phase, request_ids=["gen-1"],
                              position=position or 0, has_position=position is not None)
    s.results.add().moments.CopyFrom(telemetry_pb2.Moments(count=4, mean=mean, std=1.0))
    return s


def _step(step: int, tokens: Sequence[tuple[int, int, int, str]], *, summaries: Sequence[Any] = (),
          captures: Sequence[Any] = ()) -> Any:
    """A step message; tokens are (sequence, id, position, text)."""
    return inference_pb2.GenerateResponse(
        phase=PHASE.PHASE_PREFILL if step == 0 else PHASE.PHASE_DECODE, step=step,
        tokens=[inference_pb2.GeneratedToken(sequence=s, id=i, position=p, logprob=-0.5 * (i % 3), text=t)
                for s, i, p, t in tokens],
        summaries=list(summaries), captures=list(captures))


def _finished(reasons: Sequence[int], prompt_tokens: int, generated: int, dropped: int = 0) -> Any:
    return inference_pb2.GenerateResponse(finished=inference_pb2.GenerationFinished(
        prompt_tokens=prompt_tokens, generated_tokens=generated, time_to_first_token_seconds=0.0125,
        time_per_output_token_seconds=0.004, finish_reasons=list(reasons), dropped=dropped))


def _text_script() -> list[Any]:
    """One prompt of 3 tokens, 3 new tokens with text, a `model.layers.0` tap."""
    return [
        _started([[1, 2, 3]], tap_ids=["gen-1/0"]),
        _step(0, [(0, 10, 3, "Hello")], summaries=[_summary("model.layers.0", 0.5, PHASE.PHASE_PREFILL, 3, 7)]),
        _step(1, [(0, 11, 4, " wor")], summaries=[_summary("model.layers.0", -0.25, PHASE.PHASE_DECODE, 4, 8)]),
        _step(2, [(0, 12, 5, "ld")], summaries=[_summary("model.layers.0", 0.125, PHASE.PHASE_DECODE, 5, 9)]),
        _finished([FINISH.FINISH_REASON_LENGTH], 3, 3),
    ]


def test_step_conversion() -> None:
    cap = inference_pb2.StepCapture(layer="model.norm", call_index=1, tensor=tensor_pb2.Tensor(
        dtype=tensor_pb2.DATA_TYPE_BFLOAT16, shape=[1, 2], raw_data=np.array([0x3F80, 0xC000], "<u2").tobytes()))
    msg = _step(4, [(0, 9, 20, ""), (1, 8, 17, "x")], summaries=[_summary("lm_head", 1.5, PHASE.PHASE_DECODE, None, 3)],
                captures=[cap])
    step = gen.step_from_proto(msg)
    assert (step.phase, step.step) == ("decode", 4)
    assert step.tokens[0] == layertap.GeneratedToken(0, 9, 20, -0.0, "")
    assert step.tokens[1] == layertap.GeneratedToken(1, 8, 17, pytest.approx(-1.0), "x")  # type: ignore[arg-type]
    (s,) = step.summaries
    assert (s.phase, s.position, s.request_ids) == ("decode", None, ("gen-1",))
    (c,) = step.captures
    assert c.layer == "model.norm" and c.call_index == 1
    np.testing.assert_array_equal(c.tensor, np.array([[1.0, -2.0]], np.float32))  # bf16 widened
    assert gen.step_from_proto(_step(0, [])).phase == "prefill"


class FakeCall:
    """A Generate call over a list: what the transport's stream gives, with its cancel."""

    def __init__(self, messages: Sequence[Any], error: Exception | None = None) -> None:
        self._messages = iter(messages)
        self._error = error
        self.cancelled = False

    def __iter__(self) -> FakeCall:
        return self

    def __next__(self) -> Any:
        if self.cancelled:
            raise LayertapError("cancelled", code="CANCELLED")
        for msg in self._messages:
            return msg
        if self._error is not None:
            raise self._error
        raise StopIteration

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def _generation(messages: Sequence[Any], error: Exception | None = None) -> tuple[layertap.Generation, FakeCall]:
    call = FakeCall(messages, error)
    return layertap.Generation(call, nullcontext), call


def test_generation_reads_started_then_steps_then_finished() -> None:
    g, call = _generation(_text_script())
    assert (g.request_id, g.tap_ids, g.prompts) == ("gen-1", ["gen-1/0"], [[1, 2, 3]])
    steps = list(g)
    assert [(s.phase, s.step, [t.id for t in s.tokens]) for s in steps] == [
        ("prefill", 0, [10]), ("decode", 1, [11]), ("decode", 2, [12])]
    assert [s.summaries[0].position for s in steps] == [3, 4, 5]
    assert g.done and not call.cancelled
    result = g.result()
    assert result == layertap.GenerationResult(
        request_id="gen-1", prompts=[[1, 2, 3]], sequences=[[10, 11, 12]], texts=["Hello world"],
        finish_reasons=["length"], prompt_tokens=3, generated_tokens=3, time_to_first_token=0.0125,
        time_per_output_token=0.004, dropped=0)


def test_result_drains_what_iteration_left() -> None:
    script = [_started([[1], [2, 3]]),
              _step(0, [(0, 5, 1, ""), (1, 6, 2, "")]),
              _step(1, [(1, 7, 3, "")]),
              _finished([FINISH.FINISH_REASON_STOP, FINISH.FINISH_REASON_LENGTH], 3, 3, dropped=2)]
    g, _ = _generation(script)
    next(g)
    result = g.result()
    assert result.sequences == [[5], [6, 7]] and result.texts == ["", ""]
    assert result.finish_reasons == ["stop", "length"] and result.dropped == 2
    assert list(g) == [] and g.result() == result  # drained: both are repeatable


def test_summaries_may_come_alone() -> None:
    """The server sends summaries that were reduced between steps, and the last ones with the end."""
    late = _summary("model.layers.0", 0.5, PHASE.PHASE_DECODE, 4, 8)
    last = _finished([FINISH.FINISH_REASON_LENGTH], 3, 2)
    last.summaries.append(_summary("model.layers.0", 0.25, PHASE.PHASE_DECODE, 5, 9))
    script = [_started([[1, 2, 3]]), _step(0, [(0, 10, 3, "")]),
              inference_pb2.GenerateResponse(summaries=[late]), _step(1, [(0, 11, 4, "")]), last]
    g, _ = _generation(script)
    steps = list(g)
    assert [(s.phase, len(s.tokens), [x.position for x in s.summaries]) for s in steps] == [
        ("prefill", 1, []), ("", 0, [4]), ("decode", 1, []), ("", 0, [5])]
    assert g.result().sequences == [[10, 11]]


def test_started_may_share_its_message_with_the_first_step() -> None:
    first = _started([[1, 2]])
    first.MergeFrom(_step(0, [(0, 3, 2, "")]))
    g, _ = _generation([first, _finished([FINISH.FINISH_REASON_LENGTH], 2, 1)])
    assert [t.id for s in g for t in s.tokens] == [3]


@pytest.mark.parametrize(("script", "match", "open_call"), [
    ([], "did not start", False),
    ([_step(0, [(0, 1, 1, "")])], "did not start", True),
    ([_started([[1]]), _step(0, [(0, 1, 1, "")])], "ended before its GenerationFinished", False),
    ([_started([[1]]), _started([[1]])], "second GenerationStarted", True),
    ([_started([[1]]), _step(0, [(1, 1, 1, "")])], "sequence 1, of 1 prompts", True),
])
def test_a_stream_that_breaks_the_contract_is_a_protocol_error(script: list[Any], match: str, open_call: bool) -> None:
    call = FakeCall(script)
    with pytest.raises(ProtocolError, match=match):
        list(layertap.Generation(call, nullcontext))
    assert call.cancelled == open_call  # a call still open is ended on the server's side too


def test_cancel_ends_iteration_and_result_says_cancelled() -> None:
    g, call = _generation(_text_script())
    next(g)
    g.cancel()
    assert call.cancelled and list(g) == []
    with pytest.raises(LayertapError, match="cancelled before it finished") as info:
        g.result()
    assert info.value.code == "CANCELLED"
    g.cancel()  # idempotent
    with _generation(_text_script())[0] as g2:
        pass
    assert "cancelled" in repr(g2)


def test_cancel_after_the_end_keeps_the_result() -> None:
    g, call = _generation(_text_script())
    list(g)
    g.cancel()
    assert g.result().sequences == [[10, 11, 12]]


# --------------------------------------------------------------------------- through a gRPC server


class ScriptedGenerate(grpc.GenericRpcHandler):
    """InferenceService.Generate that sends ``responses``, then aborts with ``status`` or holds the call open."""

    def __init__(self) -> None:
        self.responses: list[Any] = []
        self.requests: list[Any] = []
        self.status: grpc.Status | None = None
        self.hold_open = False
        self.ended = threading.Event()

    def service(self, call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if call_details.method != "/layertap.v1.InferenceService/Generate":  # type: ignore[attr-defined]
            return None

        def generate(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self.requests.append(request)
            try:
                yield from self.responses
                if self.status is not None:
                    context.abort_with_status(self.status)
                while self.hold_open and context.is_active():
                    time.sleep(0.01)
            finally:
                self.ended.set()

        return grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=inference_pb2.GenerateRequest.FromString,
            response_serializer=inference_pb2.GenerateResponse.SerializeToString)


def _status(code: grpc.StatusCode, message: str, reason: str) -> grpc.Status:
    info = Any_pb2()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="layertap.dev"))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[info]))


@pytest.fixture()
def scripted(grpc_server: Callable[..., str]) -> tuple[ScriptedGenerate, str]:
    handler = ScriptedGenerate()
    return handler, grpc_server(handler)


def test_client_generate_end_to_end(scripted: tuple[ScriptedGenerate, str]) -> None:
    handler, target = scripted
    handler.responses = _text_script()
    with layertap.Client(target) as client:
        g = client.generate("Hi", max_new_tokens=3, taps=["model.layers.0"], capture=["model.norm"])
        assert g.request_id == "gen-1"
        result = g.result()
    assert result.texts == ["Hello world"]
    (req,) = handler.requests
    assert list(req.texts) == ["Hi"] and req.max_new_tokens == 3 and req.taps[0].selector == "model.layers.0"


def test_errors_are_translated_with_hints(scripted: tuple[ScriptedGenerate, str]) -> None:
    handler, target = scripted
    handler.status = _status(grpc.StatusCode.FAILED_PRECONDITION, "hf:/m has no tokenizer", "NO_TOKENIZER")
    with layertap.Client(target) as client:
        with pytest.raises(FailedPrecondition) as info:
            client.generate("Hi")  # raises from the call: the first message is read there
    assert info.value.reason == "NO_TOKENIZER" and "prompt=" in info.value.hint


def test_an_error_mid_stream_raises_from_iteration(scripted: tuple[ScriptedGenerate, str]) -> None:
    handler, target = scripted
    handler.responses = _text_script()[:2]
    handler.status = _status(grpc.StatusCode.INTERNAL, "logits held NaN", "NONFINITE_LOGITS")
    with layertap.Client(target) as client:
        g = client.generate([1, 2, 3])
        assert [t.id for t in next(g).tokens] == [10]
        with pytest.raises(LayertapError, match="logits held NaN") as info:
            next(g)
    assert info.value.code == "INTERNAL" and info.value.reason == "NONFINITE_LOGITS"


def test_cancel_reaches_the_server(scripted: tuple[ScriptedGenerate, str]) -> None:
    handler, target = scripted
    handler.responses = _text_script()[:2]
    handler.hold_open = True
    with layertap.Client(target) as client:
        with client.generate([1, 2, 3]) as g:
            next(g)
        assert handler.ended.wait(5), "the server's call did not end"
        with pytest.raises(LayertapError, match="cancelled"):
            g.result()


def test_deadline_names_timeout(scripted: tuple[ScriptedGenerate, str]) -> None:
    handler, target = scripted
    handler.responses = _text_script()[:2]
    handler.hold_open = True
    with layertap.Client(target) as client:
        g = client.generate([1, 2, 3], timeout=0.3)
        with pytest.raises(layertap.DeadlineExceeded) as info:
            g.result()
    assert "timeout=" in info.value.hint and "max_new_tokens=" in info.value.hint


# --------------------------------------------------------------------------- the CLI


def test_cli_streams_text_inline(scripted: tuple[ScriptedGenerate, str], capsys: pytest.CaptureFixture[str]) -> None:
    handler, target = scripted
    handler.responses = _text_script()
    assert main(["generate", target, "Hi", "--max-new-tokens", "3", "--stop", "2", "--stop", "7"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Hello world"
    assert out[1] == ("3 tokens generated from 3 prompt tokens; time to first token 12.5 ms; "
                      "4.00 ms per output token; finish: length")
    (req,) = handler.requests
    assert list(req.stop_token_ids) == [2, 7] and not req.do_sample and not req.taps


def test_cli_prints_ids_without_a_tokenizer(scripted: tuple[ScriptedGenerate, str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    handler, target = scripted
    handler.responses = [_started([[1, 2]]), _step(0, [(0, 10, 2, "")]), _step(1, [(0, 11, 3, "")]),
                         _finished([FINISH.FINISH_REASON_STOP], 2, 2)]
    assert main(["generate", target, "--ids", "1,2", "--temperature", "0.5", "--seed", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "10 11"
    (req,) = handler.requests
    assert [list(p.ids) for p in req.prompts] == [[1, 2]] and req.do_sample and req.has_seed and req.seed == 3


def test_cli_watch_prints_a_line_of_layer_means_per_pass(scripted: tuple[ScriptedGenerate, str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    handler, target = scripted
    handler.responses = _text_script()
    assert main(["generate", target, "Hi", "--watch", "model.layers.*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    watch = [line for line in lines if "model.layers.0" in line]
    assert watch == ["pos 3 prefill  model.layers.0 0.5", "pos 4 decode  model.layers.0 -0.25",
                     "pos 5 decode  model.layers.0 0.125"]
    assert lines[1] == "pos 3 prefill  id 10  'Hello'  logprob -0.5000"
    (req,) = handler.requests
    (tap,) = req.taps
    assert tap.selector == "model.layers.*" and [r.kind for r in tap.reducers] == [telemetry_pb2.REDUCER_KIND_MOMENTS]


def test_cli_json_lines(scripted: tuple[ScriptedGenerate, str], capsys: pytest.CaptureFixture[str]) -> None:
    handler, target = scripted
    handler.responses = _text_script()
    assert main(["generate", target, "--ids", "1,2,3", "--ids", "4", "--json", "--watch", "model.layers.0"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["kind"] for o in objects] == ["token", "layers"] * 3 + ["result"]
    assert objects[0] == {"phase": "prefill", "step": 0, "sequence": 0, "id": 10, "position": 3, "logprob": -0.5,
                          "text": "Hello", "kind": "token"}
    assert objects[1]["means"] == {"model.layers.0": 0.5} and objects[1]["position"] == 3
    assert objects[-1]["texts"] == ["Hello world"] and objects[-1]["finish_reasons"] == ["length"]
    assert [list(p.ids) for p in handler.requests[0].prompts] == [[1, 2, 3], [4]]


def test_cli_errors_name_flags(scripted: tuple[ScriptedGenerate, str], capsys: pytest.CaptureFixture[str]) -> None:
    handler, target = scripted
    handler.status = _status(grpc.StatusCode.FAILED_PRECONDITION, "no tokenizer", "NO_TOKENIZER")
    assert main(["generate", target, "Hi"]) == 1
    err = capsys.readouterr().err
    assert "--ids ID,ID,..." in err and "prompt=" not in err
    assert main(["generate", target]) == 2
    assert main(["generate", target, "Hi", "--ids", "1"]) == 2
    assert "not both" in capsys.readouterr().err
