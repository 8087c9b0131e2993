"""``layertap.attach``: serve a training process's own model, in background threads.

The agent is the serving stack of :mod:`layertap.server.app` (same services,
interceptors, auth, TLS and protected mode) around a *training* host: the
user's loop runs the model, the agent only observes. Anything that would run
the model itself (``Infer``, active captures) is refused with
FAILED_PRECONDITION by the host.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from layertap.server.app import process_compilation, start_server
from layertap.server.compile.kernel import BATCH, DENSE, Signature
from layertap.server.config import ServerConfig, check_exposure
from layertap.server.host.model_host import ModelHost, PassContext
from layertap.server.host.sources import LoadedModel
from layertap.server.reducers.batched import BATCH_DTYPES
from layertap.server.running import LayertapServer
from layertap.server.train.labels import LabelledRegistry
from layertap.server.train.names import is_compiled, unwrap
from layertap.server.train.ranks import Rank
from layertap.server.train.steps import StepTracker, step_number

log = logging.getLogger("layertap.server")

#: ServerConfig fields that describe a model to load: an agent hosts the caller's.
_MODEL_FIELDS = frozenset({"model", "seed", "weights", "input_shape", "input_dtype", "device", "dtype",
                           "model_args", "hf_class", "trust_remote_code"})
_CONFIG_FIELDS = frozenset(f.name for f in fields(ServerConfig)) - _MODEL_FIELDS
#: Seconds attach() waits for the statistics kernel (compile_reducers=True):
#: 12 s with an empty cache on 2 cores, 1.1 s from the package cache.
COMPILE_TIMEOUT = 300.0


class Agent:
    """A running agent; a context manager. Close it to remove every hook and stop the servers.

    Attributes:
        port: The bound gRPC port.
        metrics_port: The bound ``/metrics`` port (None: metrics off).
        rank: This process's rank, local rank and world size.
    """

    def __init__(self, server: LayertapServer, steps: StepTracker, rank: Rank, *, compiles: bool = False) -> None:
        self.server = server
        self.steps = steps
        self.rank = rank
        self.port = server.port
        self.metrics_port = server.metrics_port
        #: Whether this agent turned background compiles off (compile_reducers=True); close turns them back on.
        self.compiles = compiles
        self._closed = False

    @property
    def host(self) -> ModelHost:
        return self.server.state.host

    @property
    def address(self) -> str:
        """``host:port`` for ``layertap.Client``."""
        return self.server.address

    @property
    def hooks(self) -> int:
        """Torch hooks taps and captures hold on the model now (the step hooks not counted)."""
        return self.host.hooks.active

    def step(self, index: int) -> contextlib.AbstractContextManager[PassContext]:
        """``with agent.step(i):`` marks training step ``i`` when no optimizer was attached."""
        return self.steps.step(index)

    def close(self) -> None:
        """End any open step, remove the hooks, stop both servers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.steps.close()
        self.server.stop(0)
        if self.compiles:
            process_compilation().stats.background = True

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<layertap Agent {self.address} rank={self.rank.rank}/{self.rank.world_size}>"


def _compile_before_training(device: torch.device, dtype: torch.dtype) -> None:
    """The statistics kernels for the parameters' dtype, now, while no step draws
    random numbers; on CPU they serve gradients in every mode (compile.aoti)."""
    started = time.monotonic()
    sig = Signature(device, dtype, DENSE, grad=True, inference=False, autocast=None)
    stats = process_compilation().stats
    ready = stats.compile_now(sig, timeout=COMPILE_TIMEOUT)
    if dtype in BATCH_DTYPES:  # the small tensors' kernel too, run at each pass's end (reducers.batched)
        batch = Signature(device, dtype, BATCH, grad=False, inference=True, autocast=None)
        ready = stats.compile_now(batch, timeout=COMPILE_TIMEOUT) and ready
    log.info("layertap.attach: statistics kernel for %s %s %s in %.1f s; the training process never compiles "
             "in the background", device, dtype, "ready" if ready else "NOT ready (eager)", time.monotonic() - started)


def _placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where the model's parameters live and their floating dtype (for metadata only)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    port: int = 0,
    metrics_port: int | None = 0,
    host: str = "127.0.0.1",
    auth_tokens: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    insecure: bool = False,
    start_step: int = 0,
    name: str | None = None,
    **options: Any,
) -> Agent:
    """Start a layertap agent for ``model`` inside this (training) process.

    Args:
        model: The model the loop trains; DDP and ``torch.compile`` wrappers
            are looked through, so layer names are the user's.
        optimizer: Its step hooks delimit steps and its pre-step is where
            parameter gradients are read. None: mark steps with ``agent.step(i)``.
        port: gRPC port; a nonzero port is a base, this rank listens on
            ``port + LOCAL_RANK``. 0 picks a free port.
        metrics_port: ``/metrics`` port, the same way; None: no metrics.
        host: Bind address; loopback by default. Anything else needs
            ``auth_tokens`` and ``tls_cert``/``tls_key`` or ``insecure=True``,
            as for ``layertap serve``.
        auth_tokens, tls_cert, tls_key, tls_client_ca: As ``layertap serve``'s flags.
        start_step: The number of the first optimizer step.
        name: The ``model`` label and metadata name (default: the class name).
        **options: Other :class:`~layertap.server.config.ServerConfig` fields
            (``max_taps``, ``subscriber_queue``...).

    Raises:
        TypeError: An unknown option, or one that loads a model.
        ValueError: A refused exposure, a bad token file or rank variable.
        OSError: A port cannot be bound.
    """
    unknown = sorted(set(options) - _CONFIG_FIELDS)
    if unknown:
        raise TypeError(f"attach() got unexpected option(s): {', '.join(unknown)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
    rank = Rank.from_env()
    config = ServerConfig(host=host, port=rank.port(port) or 0, metrics_port=rank.port(metrics_port),
                          auth_tokens=auth_tokens, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca,
                          insecure=insecure, compile_reducers=False)
    for key, value in options.items():
        setattr(config, key, value)
    if (why := check_exposure(config)) is not None:
        raise ValueError(f"layertap.attach: {why} (keywords auth_tokens=, tls_cert=, tls_key=, insecure=True)")
    step_number(start_step, "start_step")  # refused before any server starts
    inner = unwrap(model)
    if is_compiled(model):
        # Dynamo skips guards on module hooks by default, so a tap added after
        # the first compiled forward would never fire (and nothing would say
        # so). Guarding on hooks makes each tap change recompile instead.
        import torch._dynamo.config  # noqa: PLC0415 - only compiled models pay for dynamo

        torch._dynamo.config.skip_nnmodule_hook_guards = False
        log.info("layertap.attach: torch.compile'd model; module hooks are guarded, so adding or removing "
                 "a tap recompiles the model once")
    device, dtype = _placement(inner)
    loaded = LoadedModel(inner, name or type(inner).__name__,
                         f"training (rank {rank.rank} of {rank.world_size})", inputs=[])
    training_host = ModelHost(loaded, device=device, dtype=dtype, training=True)
    training_host.rank = (rank.rank, rank.world_size)
    if config.compile_reducers:
        process_compilation().stats.background = False  # before any tap can queue one: see CompiledStats.background
    server = start_server(config, host=training_host, registry=LabelledRegistry({"rank": str(rank.rank)}))
    if config.compile_reducers:
        _compile_before_training(device, dtype)
    try:
        steps = StepTracker(training_host, optimizer, start_step=start_step)
    except BaseException:
        server.stop(0)
        raise
    log.info("layertap agent for %s on %s (rank %d of %d)", loaded.name, server.address, rank.rank, rank.world_size)
    return Agent(server, steps, rank, compiles=config.compile_reducers)
