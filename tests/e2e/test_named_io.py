"""Named and several inputs, and structured outputs with names, through a real server and client.

Models come from factories (``--model support.named_models:...``) declared with
``--input NAME:DTYPE:SHAPE``; every result is compared with the same model run locally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.named_models import VOCAB, conv_with_dict_output, tiny_bert, tiny_gpt2, tuple_with_none

from layertap import Client, Incidents, InvalidArgument, SkippedOutput
from layertap.server.host.sources import InputSpec, LoadedModel

pytestmark = pytest.mark.e2e

pytest.importorskip("transformers")

TOKEN_INPUTS = ["input_ids:int64:-1,-1", "attention_mask:int64:-1,-1"]


def _batch() -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(1).integers(1, VOCAB, size=(2, 6)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 4:] = 0  # the second sequence is padded
    ids[1, 4:] = 0
    return ids, mask


@pytest.fixture
def bert(make_server):
    srv = make_server(model="support.named_models:tiny_bert", inputs=TOKEN_INPUTS)
    with Client(f"127.0.0.1:{srv.port}") as c:
        yield c


def _local_bert(ids: np.ndarray, mask: np.ndarray):
    with torch.inference_mode():
        return tiny_bert()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))


def test_metadata_lists_every_input_with_free_dims(bert):
    specs = [(s.name, s.dtype, tuple(s.shape)) for s in bert.metadata().inputs]
    assert specs == [("input_ids", "int64", (-1, -1)), ("attention_mask", "int64", (-1, -1))]


def test_demo_metadata_names_forwards_argument(client):
    (spec,) = client.metadata().inputs
    assert spec.name == "x"
    x = np.zeros((1, 3, 32, 32), np.float32)
    np.testing.assert_array_equal(client.infer(x=x), client.infer(x))


def test_keywords_dict_and_positional_equal_the_local_model_on_a_padded_batch(bert):
    ids, mask = _batch()
    want = _local_bert(ids, mask)
    by_keyword = bert.infer(input_ids=ids, attention_mask=mask)
    by_dict = bert.infer({"input_ids": ids, "attention_mask": mask})
    positional = bert.infer(ids, mask)
    mixed = bert.infer(ids, attention_mask=mask)
    for out in (by_keyword, by_dict, positional, mixed):
        assert isinstance(out, dict) and list(out) == list(want.keys())  # ModelOutput keys, in order
        for key, value in want.items():
            np.testing.assert_allclose(out[key], value.numpy(), rtol=1e-5, atol=1e-5)
        assert out.skipped == ()
    # The mask matters: without it the padded row differs.
    unmasked = bert.infer(input_ids=ids, attention_mask=np.ones_like(mask))
    assert not np.allclose(unmasked["last_hidden_state"][1], by_keyword["last_hidden_state"][1], atol=1e-4)


def test_missing_and_unexpected_names_are_invalid_argument_naming_them(bert):
    ids, mask = _batch()
    with pytest.raises(InvalidArgument, match=r"missing input\(s\) 'attention_mask'.*\[input_ids, attention_mask\]"):
        bert.infer(input_ids=ids)
    with pytest.raises(InvalidArgument, match=r"unexpected input 'token_type_ids'.*\[input_ids, attention_mask\]"):
        bert.infer(input_ids=ids, attention_mask=mask, token_type_ids=mask)
    with pytest.raises(InvalidArgument, match=r"given twice"):
        bert.infer(ids, mask, input_ids=ids)
    with pytest.raises(InvalidArgument, match=r"attention_mask.*expected int64"):
        bert.infer(input_ids=ids, attention_mask=mask.astype(np.float32))
    with pytest.raises(InvalidArgument, match=r"expected 2 input tensor\(s\)"):
        bert.infer(ids, mask, mask)


def test_capture_with_a_dict_input_equals_a_local_hook(bert):
    ids, mask = _batch()
    model, seen = tiny_bert(), []
    model.embeddings.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    with torch.inference_mode():
        model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    got = bert.capture("embeddings", input={"input_ids": ids, "attention_mask": mask})
    np.testing.assert_allclose(got, seen[0].numpy(), rtol=1e-5, atol=1e-5)


def test_a_cache_object_is_listed_as_skipped(make_server):
    srv = make_server(model="support.named_models:tiny_gpt2", inputs=TOKEN_INPUTS)
    ids, mask = _batch()
    with torch.inference_mode():
        want = tiny_gpt2()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    with Client(f"127.0.0.1:{srv.port}") as c:
        out = c.infer(input_ids=ids, attention_mask=mask)
    assert isinstance(out, dict) and "logits" in out
    np.testing.assert_allclose(out["logits"], want.logits.numpy(), rtol=1e-5, atol=1e-5)
    caches = [(k, type(v).__name__) for k, v in want.items() if not isinstance(v, torch.Tensor)]
    assert caches and "Cache" in caches[0][1]  # the model's own cache object, whatever transformers names its field
    assert out.skipped == tuple(SkippedOutput(k, t) for k, t in caches)
    assert list(out) == [k for k, v in want.items() if isinstance(v, torch.Tensor)]


def test_a_tuple_keeps_its_none_in_place(make_server):
    srv = make_server(model="support.named_models:tuple_with_none", input_shape="-1,4")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with torch.inference_mode():
        a, _, b = tuple_with_none()(torch.from_numpy(x))
    with Client(f"127.0.0.1:{srv.port}") as c:
        assert [s.name for s in c.metadata().inputs] == ["x"]
        out = c.infer(x)
    assert isinstance(out, list) and len(out) == 3 and out[1] is None
    np.testing.assert_allclose(out[0], a.numpy(), rtol=1e-6)
    np.testing.assert_allclose(out[2], b.numpy(), rtol=1e-6)
    assert out.skipped == (SkippedOutput("output1", "NoneType"),)


def test_explain_takes_logits_or_the_named_output(make_server):
    model = conv_with_dict_output()
    srv = make_server(LoadedModel(model, "dict", "factory", [InputSpec("x", torch.float32, (-1, 3, 8, 8))]))
    x = np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32)
    with torch.no_grad():
        out = model(torch.from_numpy(x))
    with Client(f"127.0.0.1:{srv.port}") as c:
        by_default = c.explain(x, "body")
        np.testing.assert_allclose(by_default.scores, out["logits"].max(dim=1).values.numpy(), rtol=1e-5)
        other = c.explain({"x": x}, "body", output_name="other")
        np.testing.assert_allclose(other.scores, out["other"].max(dim=1).values.numpy(), rtol=1e-5)
        with pytest.raises(InvalidArgument, match="no tensor output 'nope'.*logits, other"):
            c.explain(x, "body", output_name="nope")


def test_smoke_serves_a_token_model_with_a_dict_output(tmp_path):
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "layertap.cli", "serve", "--smoke", "--port", "0", "--no-metrics",
                           "--model", "support.named_models:tiny_gpt2", *[f"--input={i}" for i in TOKEN_INPUTS]],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"infer output (2, 2, {VOCAB})" in done.stdout, done.stdout  # logits: (batch, tokens, vocab)


def test_the_flight_recorder_replays_keyword_inputs(make_server, tmp_path):
    taps = tmp_path / "taps.json"
    taps.write_text(json.dumps({"taps": [{
        "name": "guard", "selector": "encoder.layer.1.output", "reducers": ["moments", "minmax", "abs_max"],
        "triggers": {"abs_max_above": 0.5}}]}))
    srv = make_server(model="support.named_models:tiny_bert", inputs=TOKEN_INPUTS, tap_config=str(taps),
                      incident_dir=str(tmp_path / "incidents"), record_inputs=16)
    ids, mask = _batch()
    with Client(f"127.0.0.1:{srv.port}") as c:
        c.infer(input_ids=ids, attention_mask=mask)
        assert srv.state.taps.flush(10) and srv.state.recorder.wait_idle(30)
        (info, *_) = Incidents(c).list()
        # The padded row depends on the mask: a replay that dropped the keyword would not match.
        assert info.replayed and info.replay_matches, info.replay_note
        inc = Incidents(c).get(info.id)
    assert len(inc.inputs) == 2
    np.testing.assert_array_equal(inc.inputs[0], ids)
    np.testing.assert_array_equal(inc.inputs[1], mask)
