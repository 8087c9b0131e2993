"""Layer integrated gradients of token models served as ``hf:DIR``: per-token attributions, padding left out.

Tiny random-init models (``tests/support/hf_models.py``), saved with
``save_pretrained`` and served in process by ``--model hf:DIR``. The BERT's
weights are drawn wider than transformers' default (``initializer_range``
0.3, not 0.02): at the default the tiny model is so nearly linear in its
embeddings that 8 steps already integrate it to float32's noise, and "fewer
steps, larger residual" could not show. Completeness is checked against
F(input) and F(baseline) computed here with transformers.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
    pytest.skip("transformers is not installed (pip install 'layertap[hf]')", allow_module_level=True)

from support import hf_models

import layertap

pytestmark = pytest.mark.e2e

captum_attr = pytest.importorskip("captum.attr")

VOCAB = hf_models.TINY["bert"][2]["vocab_size"]
EMBEDDING = "bert.embeddings.word_embeddings"


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path, model = hf_models.save("bert", tmp_path_factory.mktemp("hf"), initializer_range=0.3)
    hf_models.save_word_tokenizer(path, VOCAB)
    return path, model


@pytest.fixture
def client(make_server, bert) -> Iterator[layertap.Client]:  # type: ignore[no-untyped-def]
    srv = make_server(model=f"hf:{bert[0]}")
    with layertap.Client(f"127.0.0.1:{srv.port}") as c:
        c.port = srv.port  # type: ignore[attr-defined]
        yield c


def tokens() -> tuple[np.ndarray, np.ndarray]:
    """Two sequences of six ids; the second is padded after four (mask 0, and pad ids that are not 0)."""
    ids = hf_models.example_input("bert", batch=2, tokens=6, seed=3).numpy()
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    ids[1, 4:] = 7
    return ids, mask


def scores(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, classes: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    return logits.double().numpy()[np.arange(len(ids)), classes]


def padded_baseline(ids: np.ndarray, mask: np.ndarray, base: np.ndarray | int = 0) -> np.ndarray:
    """The baseline the server integrates from: ``base`` where there are tokens, the input's ids where padding."""
    return np.where(mask == 0, ids, base)


def test_per_token_attributions_satisfy_completeness_and_leave_padding_out(client, bert) -> None:  # type: ignore[no-untyped-def]
    ids, mask = tokens()
    x = {"input_ids": ids, "attention_mask": mask}
    fine = client.explain(x, method="layer_integrated_gradients", n_steps=128)
    coarse = client.explain(x, method="lig", n_steps=8)
    assert fine.layer == EMBEDDING and fine.method == "layer_integrated_gradients"
    assert fine.attributions.shape == ids.shape and fine.attributions.dtype == np.float32
    assert np.all(fine.attributions[1, 4:] == 0)  # padding, though its ids (7) are not the baseline's (0)
    # A token whose id is the baseline's (0) does not move along the path either; every other one counts.
    assert np.all((fine.attributions != 0) == ((mask == 1) & (ids != 0)))
    assert fine.tokens == [[f"w{i}" for i in row] for row in ids]
    base = padded_baseline(ids, mask)
    gap = scores(bert[1], ids, mask, fine.classes) - scores(bert[1], base, mask, fine.classes)
    assert np.all(np.abs(gap) > 0.1), gap
    res = fine.attributions.astype(np.float64).sum(axis=1) - gap
    coarse_res = coarse.attributions.astype(np.float64).sum(axis=1) - gap
    assert np.all(np.abs(res) <= 0.01 * np.abs(gap)), np.abs(res) / np.abs(gap)
    np.testing.assert_allclose(fine.delta, res, rtol=0, atol=1e-5)
    np.testing.assert_allclose(coarse.delta, coarse_res, rtol=0, atol=1e-5)
    assert np.abs(res).max() < np.abs(coarse_res).max()


def test_equal_to_captum_run_here(client, bert) -> None:  # type: ignore[no-untyped-def]
    ids, mask = tokens()
    found = client.explain({"input_ids": ids, "attention_mask": mask}, method="lig", target=[2, 0], n_steps=24,
                           internal_batch_size=12)
    model = bert[1]

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits

    lig = captum_attr.LayerIntegratedGradients(forward, model.get_input_embeddings())
    want, delta = lig.attribute(torch.from_numpy(ids), baselines=torch.from_numpy(padded_baseline(ids, mask)),
                                target=[2, 0], additional_forward_args=(torch.from_numpy(mask),), n_steps=24,
                                internal_batch_size=12, return_convergence_delta=True)
    per_token = want.detach().sum(dim=-1).numpy() * (mask != 0)
    np.testing.assert_allclose(found.attributions, per_token, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(found.delta, delta.numpy(), rtol=1e-4, atol=1e-6)
    assert found.classes == [2, 0] and found.internal_batches == 1 + 1 + 24 // 6 + 1


def test_a_given_baseline_of_token_ids(client, bert) -> None:  # type: ignore[no-untyped-def]
    ids, mask = tokens()
    given = np.full((1, 6), 1, dtype=np.int64)  # "w1" at every position, for every sample
    found = client.explain({"input_ids": ids, "attention_mask": mask}, method="lig", n_steps=128, baseline=given)
    gap = scores(bert[1], ids, mask, found.classes) - scores(bert[1], padded_baseline(ids, mask, given), mask,
                                                            found.classes)
    res = found.attributions.astype(np.float64).sum(axis=1) - gap
    assert np.all(np.abs(res) <= 0.01 * np.abs(gap)), np.abs(res) / np.abs(gap)
    np.testing.assert_allclose(found.delta, res, rtol=0, atol=1e-5)


def test_what_padding_holds_changes_nothing(client) -> None:  # type: ignore[no-untyped-def]
    ids, mask = tokens()
    one = client.explain({"input_ids": ids, "attention_mask": mask}, method="lig", n_steps=16)
    ids[1, 4:] = [30, 31]
    other = client.explain({"input_ids": ids, "attention_mask": mask}, method="lig", n_steps=16)
    np.testing.assert_allclose(other.attributions, one.attributions, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("call,field", [
    (dict(method="integrated_gradients"), "method"),
    (dict(method="saliency"), "method"),
    (dict(method="lig", baseline="noise"), "baseline_kind"),
    (dict(method="lig", baseline=np.zeros((2, 6), np.float32)), "baseline.dtype"),
    (dict(method="lig", baseline=np.full((2, 6), VOCAB, np.int64)), "baseline"),
    (dict(method="lig", baseline=np.zeros((2, 5), np.int64)), "baseline.shape"),
    (dict(method="lig", layer="bert.nope"), "layer"),
])
def test_bad_input_names_the_field(client, call: dict, field: str) -> None:  # type: ignore[no-untyped-def]
    ids, mask = tokens()
    with pytest.raises(layertap.LayertapError) as err:
        client.explain({"input_ids": ids, "attention_mask": mask}, **call)
    assert err.value.field == field, err.value
    assert err.value.code == ("NOT_FOUND" if field == "layer" else "INVALID_ARGUMENT")


def test_a_causal_lm_explains_one_next_token_logit(make_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Llama's output is a ModelOutput whose logits are (N, tokens, vocab): Explain takes ``logits`` and a flat target."""
    path, model = hf_models.save("llama", tmp_path, initializer_range=0.3)
    srv = make_server(model=f"hf:{path}")
    ids = hf_models.example_input("llama", batch=1, tokens=5, seed=4).numpy()
    vocab = hf_models.TINY["llama"][2]["vocab_size"]
    target = 4 * vocab + 9  # the last position's logit of token 9
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        with pytest.raises(layertap.FailedPrecondition) as err:
            client.explain({"input_ids": ids}, method="lig")
        assert err.value.field == "targets"
        found = client.explain({"input_ids": ids}, method="lig", target=target, n_steps=128)
    assert found.layer == "model.embed_tokens" and found.attributions.shape == (1, 5)
    with torch.no_grad():
        fx = model(input_ids=torch.from_numpy(ids)).logits[0, 4, 9].double()
        fb = model(input_ids=torch.zeros_like(torch.from_numpy(ids))).logits[0, 4, 9].double()
    gap = float(fx - fb)
    res = float(found.attributions.astype(np.float64).sum()) - gap
    assert abs(res) <= 0.01 * abs(gap) and abs(gap) > 0.1, (res, gap)
    np.testing.assert_allclose(found.delta, [res], rtol=0, atol=1e-5)
    assert found.scores == pytest.approx([float(fx)], rel=1e-5)


def test_cli_prints_a_token_table_without_padding(client, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from layertap.cli import main

    ids, mask = tokens()
    np.savez(tmp_path / "ids.npz", input_ids=ids, attention_mask=mask)
    assert main(["explain", str(client.port), "--input", str(tmp_path / "ids.npz"), "--method", "lig",
                 "--n-steps", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    found = client.explain({"input_ids": ids, "attention_mask": mask}, method="lig", n_steps=16)
    assert lines[0].startswith(f"sample 0: class {found.classes[0]} score ") and " delta " in lines[0]
    assert lines[1].split() == ["pos", "token", "attribution"]
    first = lines[2:8]
    assert [row.split()[:2] for row in first] == [[str(p), f"w{ids[0, p]}"] for p in range(6)]
    assert float(first[0].split()[2]) == pytest.approx(float(found.attributions[0, 0]), rel=1e-5)
    second = lines[8:]
    assert second[0].startswith("sample 1: ") and len(second) == 2 + 4  # four tokens, two padded left out
    assert [row.split()[0] for row in second[2:]] == ["0", "1", "2", "3"]
