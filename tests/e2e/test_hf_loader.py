"""``--model hf:DIR``: tiny random-init GPT-2, Llama, BERT and ViT, saved with ``save_pretrained``, served for real.

Nothing downloads: every model is built from a config in the test. Under
``CI=true`` these tests run (a missing transformers fails them); elsewhere
they skip without transformers.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

from support import hf_models

from layertap import Client, InvalidArgument
from layertap.server.codec import flatten_outputs
from layertap.server.host.sources import ModelLoadError

pytestmark = pytest.mark.e2e

KINDS = tuple(hf_models.TINY)
SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: hf_models.save(kind, root) for kind in KINDS}


def _local(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The local model's ``logits``, which the served model returns by that name."""
    with torch.no_grad():
        out = model(x)
    assert "logits" in [name for name, _ in flatten_outputs(out).tensors]
    return out.logits


@pytest.mark.parametrize("kind", KINDS)
def test_served_model_declares_its_inputs_and_matches_the_local_model(make_server, saved, kind) -> None:
    path, model = saved[kind]
    server = make_server(model=f"hf:{path}")
    loaded = server.state.host.loaded
    assert loaded.source == "hf" and type(loaded.module).__name__ == hf_models.TINY[kind][1]
    main = loaded.inputs[0]
    assert main.required and not main.keyword
    assert all(not s.required and s.keyword for s in loaded.inputs[1:])
    side = [(s.name, s.dtype, s.shape) for s in loaded.inputs[1:]]
    if kind == "vit":
        want_main = ("pixel_values", "float32", [-1, 3, 16, 16])
        assert side == []
    else:
        want_main = ("input_ids", "int64", [-1, -1])
        want_side = ["attention_mask"] + (["token_type_ids"] if kind in ("gpt2", "bert") else [])
        assert side == [(n, torch.int64, (-1, -1)) for n in want_side]
    x = hf_models.example_input(kind)
    logits = _local(model, x)
    with Client(f"127.0.0.1:{server.port}") as client:
        meta = client.metadata()
        assert [(s.name, s.dtype, list(s.shape), s.optional) for s in meta.inputs] == [
            (*want_main, False), *((name, "int64", [-1, -1], True) for name, _dtype, _shape in side)]
        assert meta.source == "hf"
        outputs = client.infer(x.numpy())
    assert isinstance(outputs, dict), "a ModelOutput comes back by name"
    np.testing.assert_allclose(outputs["logits"], logits.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_capture_of_a_decoder_layer_equals_a_local_forward_hook(make_server, saved, kind) -> None:
    path, model = saved[kind]
    layer = hf_models.TINY[kind][3]
    seen: list[torch.Tensor] = []

    def hook(_module: torch.nn.Module, _args: object, out: object) -> None:
        seen.append(out[0] if isinstance(out, tuple) else out)  # type: ignore[arg-type]

    handle = model.get_submodule(layer).register_forward_hook(hook)
    x = hf_models.example_input(kind)
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    server = make_server(model=f"hf:{path}")
    with Client(f"127.0.0.1:{server.port}") as client:
        got = client.capture(layer, input=x.numpy())
    if isinstance(got, dict):
        got = next(iter(got.values()))
    elif isinstance(got, list):
        got = got[0]
    np.testing.assert_allclose(np.asarray(got), seen[0].numpy(), rtol=1e-5, atol=1e-6)


def test_an_unknown_hf_class_fails_to_start_listing_the_known_ones(make_server, saved) -> None:
    path, _ = saved["gpt2"]
    with pytest.raises(ModelLoadError) as err:
        make_server(model=f"hf:{path}", hf_class="GPT9000Model")
    msg = str(err.value)
    assert "GPT9000Model" in msg and "GPT2LMHeadModel" in msg and "AutoModelForCausalLM (GPT2LMHeadModel)" in msg


def test_hf_class_picks_another_head(make_server, saved) -> None:
    path, _ = saved["gpt2"]
    server = make_server(model=f"hf:{path}", hf_class="AutoModel")
    assert type(server.state.host.module).__name__ == "GPT2Model"


def test_remote_code_does_not_run_without_the_flag(make_server, tmp_path) -> None:
    path, _ = hf_models.save("bert", tmp_path)
    hf_models.mark_remote_code(path)
    with pytest.raises(ModelLoadError, match=r"auto_map: .*modeling_tiny\.TinyModel.*only with --trust-remote-code"):
        make_server(model=f"hf:{path}")
    # With the flag, transformers runs the directory's code (which here raises, as a start-up error).
    with pytest.raises(ModelLoadError, match="remote code ran"):
        make_server(model=f"hf:{path}", trust_remote_code=True)


def test_an_uncached_hub_id_fails_offline_naming_the_id_and_the_switch(serve_process, tmp_path) -> None:
    # HF_HOME: an empty cache; the switches are read when huggingface_hub is imported, so in a fresh process.
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hub")}
    with pytest.raises(RuntimeError) as err:
        serve_process("--model", "hf:layertap-tests/no-such-model", "--no-metrics", env=env)
    msg = str(err.value)
    assert "'layertap-tests/no-such-model' is not a directory and not in the Hugging Face cache" in msg
    assert "HF_HUB_OFFLINE=1" in msg


def test_hf_without_transformers_names_the_extra(monkeypatch) -> None:
    import sys

    from layertap.server.host.sources import load_model

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(ModelLoadError, match=r"pip install 'layertap\[hf\]'"):
        load_model("hf:anything")


def test_model_args_reach_the_factory_by_module_and_by_file_path(make_server) -> None:
    args = ["width=6", "name=abc", "scale=0.5"]
    for ref in ("support.hf_models:factory_with_args", f"{SUPPORT / 'hf_models.py'}:factory_with_args"):
        server = make_server(model=ref, model_args=args, input_shape="-1,6")
        assert server.state.host.module.factory_args == {"width": 6, "name": "abc", "scale": 0.5}
        with Client(f"127.0.0.1:{server.port}") as client:
            assert client.infer(np.ones((2, 6), np.float32)).shape == (2, 6)


def test_a_factory_import_error_says_how_to_fix_it(make_server) -> None:
    with pytest.raises(ModelLoadError, match=r"cannot import 'no_such_pkg\.mod'.*PYTHONPATH.*path/to/mod\.py:factory"):
        make_server(model="no_such_pkg.mod:build", input_shape="-1,4")


def test_a_weights_mismatch_lists_missing_and_unexpected_keys(make_server, saved, tmp_path) -> None:
    path, model = saved["gpt2"]
    state = dict(model.state_dict())
    del state["lm_head.weight"]  # the tied weight the old message cut off
    state.update({f"extra.{i}.weight": torch.zeros(1) for i in range(25)})
    weights = tmp_path / "w.pt"
    torch.save(state, weights)
    with pytest.raises(ModelLoadError) as err:
        make_server(model=f"hf:{path}", weights=str(weights))
    msg = str(err.value)
    assert "1 missing (lm_head.weight)" in msg
    assert "25 unexpected (extra.0.weight, " in msg and "extra.19.weight and 5 more" in msg
    assert "extra.20.weight" not in msg and "\n" not in msg


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_a_padded_batch_with_its_mask_equals_the_local_model_by_name_or_position(make_server, saved, kind) -> None:
    """attention_mask is optional and goes by keyword, also when sent second and unnamed
    (GPT-2's second forward parameter is its cache, not the mask)."""
    path, model = saved[kind]
    ids = hf_models.example_input(kind)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # row 0 is left-padded
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits.numpy()
    server = make_server(model=f"hf:{path}")
    with Client(f"127.0.0.1:{server.port}") as client:
        by_name = client.infer(input_ids=ids.numpy(), attention_mask=mask.numpy())
        by_position = client.infer(ids.numpy(), mask.numpy())
    with torch.no_grad():
        unmasked = model(input_ids=ids).logits.numpy()
    mask_effect = np.abs(unmasked - want).max()
    assert mask_effect > 0, "the padding changes the local model's logits"
    for got in (by_name, by_position):
        assert isinstance(got, dict)
        np.testing.assert_allclose(got["logits"], want, rtol=1e-5, atol=1e-5)
        # The served model saw the mask: it is far closer to the masked run than the unmasked one is.
        assert np.abs(got["logits"] - want).max() < mask_effect / 10


def test_token_ids_outside_the_vocabulary_and_a_misshapen_mask_are_invalid_arguments(make_server, saved) -> None:
    """Refused before the forward, naming the input: an embedding lookup would fail with an opaque index error."""
    path, _model = saved["llama"]
    vocab = hf_models.TINY["llama"][2]["vocab_size"]
    server = make_server(model=f"hf:{path}")
    ids = hf_models.example_input("llama").numpy()
    with Client(f"127.0.0.1:{server.port}") as client:
        for bad in (vocab, -1):
            wrong = ids.copy()
            wrong[1, 2] = bad
            with pytest.raises(InvalidArgument) as err:
                client.infer(input_ids=wrong)
            assert err.value.field == "inputs[0]" and f"token id {bad}" in str(err.value), err.value
            assert f"[0, {vocab})" in str(err.value)
        with pytest.raises(InvalidArgument) as err:
            client.infer(input_ids=ids, attention_mask=np.ones((ids.shape[0], ids.shape[1] + 1), np.int64))
        assert err.value.field == "inputs[1].shape" and "input_ids's shape" in str(err.value), err.value
        assert isinstance(client.infer(input_ids=ids, attention_mask=np.ones_like(ids)), dict)  # the right mask passes
