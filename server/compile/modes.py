"""What ``--compile-mode``, ``--compile-fallback`` and ``--compile-where`` accept, and which modes a device can serve.

Apart from :mod:`.serving` so that the flags' checks (``app.py``, at start-up)
read the table without the compiled-serving machinery.
"""

from __future__ import annotations

import torch

__all__ = ["COMPILE_MODES", "CUDA_GRAPHS_VERIFIED", "CUDA_GRAPH_MODES", "FALLBACKS", "WHERE", "check_mode"]

#: ``--compile-mode`` values (inductor's modes).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
#: Modes that replay CUDA graphs on a CUDA device.
CUDA_GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})
#: CUDA-graph modes whose in-graph statistics ``tests/server/compile/test_compiled_cuda.py``
#: has verified on a lent GPU (``benchmarks/gpu_checks.sh``): reduce-overhead passed on an
#: H200, torch 2.11.0+cu130, 2026-11-26. The others are refused until their test passes.
CUDA_GRAPHS_VERIFIED = frozenset({"reduce-overhead"})
#: ``fallback`` values: what serves a tapped pass while its graph compiles.
FALLBACKS = ("eager", "pending")
#: ``where`` values: where a variant compiles (see :class:`CompiledServing`).
WHERE = ("process", "thread")


def check_mode(mode: str, device: torch.device) -> str | None:
    """Why ``mode`` cannot serve on ``device``, or None when it can."""
    if mode not in COMPILE_MODES:
        return f"--compile-mode {mode!r}: expected one of {', '.join(COMPILE_MODES)}"
    if mode in CUDA_GRAPH_MODES and device.type == "cuda" and mode not in CUDA_GRAPHS_VERIFIED:
        return (f"--compile-mode {mode} replays CUDA graphs, which skip Python hooks; layertap has not yet "
                f"verified its in-graph statistics in this mode on a GPU (tests/server/compile/"
                "test_compiled_cuda.py, run by benchmarks/gpu_checks.sh): use --compile-mode "
                f"{', '.join(sorted(CUDA_GRAPHS_VERIFIED | {'default'}))} or max-autotune-no-cudagraphs")
    return None
