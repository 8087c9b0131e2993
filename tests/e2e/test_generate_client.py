"""``Client.generate`` and ``layertap generate`` against a real ``layertap serve --model hf:DIR``.

A tiny random-init Llama with a word-level tokenizer (built here, nothing
downloads), saved with ``save_pretrained`` and served by a subprocess; the
reference is the same directory loaded locally with ``from_pretrained``.
Random-init models have tiny top-2 margins, so a greedy token is compared
only where the local logits' margin exceeds :data:`MARGIN` (past a closer
call the two may part ways); every step's log-probability is compared with a
local forward over the server's own tokens. Under ``CI=true`` these tests
run (a missing transformers fails them); elsewhere they skip without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

import torch
from support.e2e import wait_for
from support.serve import read_startup

from layertap import Client, InvalidArgument, LayerNotFound, LayertapError
from layertap.cli import main

pytestmark = pytest.mark.e2e

VOCAB = 96
LAYERS = 2
CONFIG = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          # No end-of-sequence id: every sequence runs to max_new_tokens, here and in transformers.
          "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
DECODER_LAYERS = [f"model.layers.{i}" for i in range(LAYERS)]
#: Below this top-2 logit margin, float noise may pick either token.
MARGIN = 1e-4
PROMPTS = [[5, 17, 42, 8, 3], [60, 2, 77], [11]]
SERVE = [sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--device", "cpu", "--no-compile",
         "--metrics-port", "0"]


def _word_tokenizer() -> object:
    """A word-level tokenizer over ``w0`` ... ``w94`` (id = the number), ``[UNK]`` last: text is "w5 w17"."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Llama and its tokenizer, ``save_pretrained`` into a fresh directory."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    out = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(out)
    _word_tokenizer().save_pretrained(out)  # type: ignore[attr-defined]
    return out


@pytest.fixture(scope="module")
def local(llama_dir: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()


@pytest.fixture(scope="module")
def address(llama_dir: Path) -> Iterator[str]:
    """One ``layertap serve --model hf:DIR`` for the module; stopped afterwards."""
    proc = subprocess.Popen([*SERVE, "--model", f"hf:{llama_dir}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        lines: list[str] = []
        port, _ = read_startup(proc.stdout, lines)
        if port < 0:
            proc.wait(30)
            pytest.fail(f"serve did not start: {''.join(lines)}\n{proc.stderr.read()[-3000:]}")
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def client(address: str) -> Iterator[Client]:
    with Client(address, timeout=120) as c:
        yield c


def _last_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    return out


def _hf_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def _check_against_local(model: torch.nn.Module, prompt: list[int], tokens: list[int], logprobs: list[float],
                         reference: list[int]) -> int:
    """Each token's log-probability against a local forward over the server's tokens, and each token
    against the local argmax and transformers' greedy ``reference`` up to the first close call.

    Returns how many tokens were compared with the reference."""
    compared, agreeing = 0, True
    for k, (token, logprob) in enumerate(zip(tokens, logprobs)):
        logits = _last_logits(model, prompt + tokens[:k])
        assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-4), (prompt, k)
        top2 = torch.topk(logits, 2).values
        if not agreeing or float(top2[0] - top2[1]) <= MARGIN:
            agreeing = False  # a close call: transformers may have taken the other token, and diverged from here
            continue
        assert token == int(logits.argmax()) == reference[k], (prompt, k, tokens, reference)
        compared += 1
    return compared


def test_greedy_tokens_and_logprobs_match_transformers(client: Client, local: torch.nn.Module) -> None:
    new = 8
    generation = client.generate(PROMPTS, max_new_tokens=new)  # ragged: left-padded on the server
    assert generation.prompts == PROMPTS and generation.request_id
    logprobs: list[list[float]] = [[] for _ in PROMPTS]
    positions: list[list[int]] = [[] for _ in PROMPTS]
    phases = []
    for step in generation:
        phases.append((step.phase, step.step))
        for token in step.tokens:
            logprobs[token.sequence].append(token.logprob)
            positions[token.sequence].append(token.position)
    result = generation.result()
    assert phases[0] == ("prefill", 0) and phases[1:] == [("decode", k) for k in range(1, new)]
    assert result.finish_reasons == ["length"] * len(PROMPTS)
    assert result.prompt_tokens == sum(map(len, PROMPTS)) and result.generated_tokens == new * len(PROMPTS)
    assert result.time_to_first_token > 0 and result.time_per_output_token > 0
    compared = 0
    for prompt, tokens, lps, pos in zip(PROMPTS, result.sequences, logprobs, positions):
        assert len(tokens) == new and pos == list(range(len(prompt), len(prompt) + new))
        compared += _check_against_local(local, prompt, tokens, lps, _hf_greedy(local, prompt, new))
    assert compared >= new * len(PROMPTS) // 2, "too few steps had a clear winner to compare"


def test_text_prompt_and_pieces(client: Client, local: torch.nn.Module) -> None:
    result = client.generate("w5 w17 w42", max_new_tokens=5).result()
    assert result.prompts == [[5, 17, 42]]
    assert result.texts == [" ".join(f"w{t}" for t in result.sequences[0])]


def test_cli_prints_the_tokens(address: str, client: Client, capsys: pytest.CaptureFixture[str]) -> None:
    expected = client.generate("w5 w17 w42", max_new_tokens=6).result()
    assert main(["generate", address, "w5 w17 w42", "--max-new-tokens", "6", "--timeout", "120"]) == 0
    text, final = capsys.readouterr().out.splitlines()
    assert text == expected.texts[0]
    assert final.startswith("6 tokens generated from 3 prompt tokens; time to first token ")
    assert final.endswith("finish: length")
    assert main(["generate", address, "--ids", "5,17,42", "--max-new-tokens", "6", "--json", "--timeout", "120"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["id"] for o in objects if o["kind"] == "token"] == expected.sequences[0]
    assert objects[-1]["kind"] == "result" and objects[-1]["sequences"] == expected.sequences


def test_cli_watch_prints_a_line_per_token_with_its_position(address: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    new, prompt = 5, [5, 17, 42, 8]
    assert main(["generate", address, "--ids", ",".join(map(str, prompt)), "--max-new-tokens", str(new),
                 "--watch", "model.layers.*", "--timeout", "120"]) == 0
    lines = capsys.readouterr().out.splitlines()
    watch = [line for line in lines if DECODER_LAYERS[0] in line]
    expected = [f"pos {len(prompt) + k} {'prefill' if k == 0 else 'decode'}" for k in range(new)]
    assert [line.split("  ")[0] for line in watch] == expected, lines
    assert all(all(f"{layer} " in line for layer in DECODER_LAYERS) for line in watch), watch
    assert len([line for line in lines if " id " in line]) == new


def test_step_captures_match_a_local_hook(client: Client, local: torch.nn.Module) -> None:
    prompt, new = [5, 17, 42], 3
    generation = client.generate(prompt, max_new_tokens=new, capture="model.norm")
    steps = list(generation)
    tokens = generation.result().sequences[0]
    captured: list[torch.Tensor] = []
    handle = local.model.norm.register_forward_hook(lambda module, args, out: captured.append(out.detach()))
    try:
        with torch.no_grad():
            local(input_ids=torch.tensor([prompt + tokens[:-1]]))
    finally:
        handle.remove()
    (reference,) = captured  # (1, positions, hidden): what each step's pass saw, in one forward
    assert [[c.layer for c in step.captures] for step in steps] == [["model.norm"]] * new
    prefill, *decodes = (step.captures[0].tensor for step in steps)
    assert prefill.shape == (1, len(prompt), 32) and all(d.shape == (1, 1, 32) for d in decodes)
    np.testing.assert_allclose(prefill, reference[:, :len(prompt)].numpy(), atol=1e-4)
    for k, tensor in enumerate(decodes, start=1):
        np.testing.assert_allclose(tensor[0, 0], reference[0, len(prompt) + k - 1].numpy(), atol=1e-4)


def test_step_summaries_are_this_requests(client: Client) -> None:
    generation = client.generate([5, 17, 42], max_new_tokens=3, taps=DECODER_LAYERS[0])
    summaries = [s for step in generation for s in step.summaries]
    assert [(s.phase, s.position) for s in summaries] == [("prefill", 3), ("decode", 4), ("decode", 5)]
    assert all(s.request_ids == (generation.request_id,) for s in summaries)
    assert {s.tap for s in summaries} == set(generation.tap_ids)
    assert generation.result().dropped == 0


def test_cancel_stops_the_generation_on_the_server(client: Client) -> None:
    generation = client.generate([5, 17, 42], max_new_tokens=200)
    next(generation)
    next(generation)
    generation.cancel()
    assert list(generation) == []
    with pytest.raises(LayertapError, match="cancelled") as info:
        generation.result()
    assert info.value.code == "CANCELLED"

    def quiet() -> bool:  # no pass for a while: the server's loop has let the request go
        before = client.stats().passes
        time.sleep(0.3)
        return client.stats().passes == before

    assert wait_for(quiet, timeout=10)
    assert client.stats().passes < 150, "the generation ran on after the cancel"
    # The server serves on.
    assert len(client.generate([1, 2], max_new_tokens=2).result().sequences[0]) == 2


def test_the_server_judges_what_the_client_cannot(client: Client) -> None:
    with pytest.raises(InvalidArgument) as info:
        client.generate([VOCAB + 5])
    assert info.value.field == "prompts[0]"
    with pytest.raises(InvalidArgument, match="max-new-tokens"):
        client.generate([1], max_new_tokens=10_000)
    with pytest.raises(LayerNotFound) as not_found:
        client.generate([1], capture="model.layers.9")
    assert DECODER_LAYERS[0] in not_found.value.suggestions
