"""Shared pieces of the Generate tests: the raw stub, requests, and transformers' own greedy run with hooks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import torch

from layertap.v1 import inference_pb2 as ipb
from layertap.v1 import inference_pb2_grpc


def stub_of(server: Any) -> inference_pb2_grpc.InferenceServiceStub:
    """The generated stub on a fresh channel to an in-process server."""
    return inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))


def request(*prompts: list[int], **kwargs: Any) -> ipb.GenerateRequest:
    """A GenerateRequest of token-id prompts."""
    return ipb.GenerateRequest(prompts=[ipb.TokenIds(ids=p) for p in prompts], **kwargs)


def tokens_of(responses: list[ipb.GenerateResponse], sequences: int = 1) -> list[list[ipb.GeneratedToken]]:
    """Each sequence's streamed tokens, in order."""
    out: list[list[ipb.GeneratedToken]] = [[] for _ in range(sequences)]
    for r in responses:
        for t in r.tokens:
            out[t.sequence].append(t)
    return out


def ids_of(responses: list[ipb.GenerateResponse], sequences: int = 1) -> list[list[int]]:
    """Each sequence's streamed token ids, in order."""
    return [[t.id for t in seq] for seq in tokens_of(responses, sequences)]


def local_generate(model: torch.nn.Module, prompt: list[int], new: int, layers: Sequence[str] = ()
                   ) -> tuple[list[int], list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """transformers' greedy tokens, each step's float64 log-softmax of the raw logits, and each of ``layers``'
    output (float64) at every forward of that ``generate``."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    handles = [model.get_submodule(name).register_forward_hook(
        lambda _m, _a, out, _n=name: seen[_n].append((out[0] if isinstance(out, tuple) else out).double()))
        for name in layers]
    try:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    finally:
        for h in handles:
            h.remove()
    ids = out.sequences[0, len(prompt):].tolist()
    return ids, [torch.log_softmax(s[0].double(), -1) for s in out.logits], seen
