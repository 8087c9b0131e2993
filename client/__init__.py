"""layertap: tap any layer of a served PyTorch model over gRPC.

>>> import layertap
>>> with layertap.Client("localhost:50051") as client:
...     x = client.capture("layer4")

The base install has no torch; ``as_torch=True`` needs it. Everything public
is listed in ``__all__``; modules starting with ``_`` are private.
"""

import importlib as _importlib
from typing import Any as _Any

from . import _results
from ._client import Client
from ._errors import (
    AlreadyExists,
    CaptureTooLarge,
    ClientClosed,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    LayerNotFound,
    LayertapError,
    NotFound,
    PermissionDenied,
    ProtocolError,
    ResourceExhausted,
    ServerUnavailable,
    Unauthenticated,
)
from ._explain import Explanation
from ._fleet import Fleet, FleetError, FleetItem, FleetResult, FleetStream
from ._generate import GeneratedToken, Generation, GenerationResult, GenerationStep, Prompt, StepCapture
from ._incidents import Incident, IncidentInfo, Incidents
from ._io import SkippedOutput
from ._results import *  # noqa: F403 - the result dataclasses and ReducerResult: one per kind, listed in the table module
from ._taps import SummaryStream, TapHandle
from ._types import (
    BaselineInfo,
    DriftThresholds,
    LayerDrift,
    LayerInfo,
    ModelMetadata,
    ReducerSpec,
    ServerStats,
    Structured,
    Summary,
    TapEvent,
    TapInfo,
    TapSpec,
    TensorSpec,
    Triggers,
)
from ._version import __version__


def attach(model: _Any, optimizer: _Any = None, **options: _Any) -> _Any:
    """Start a layertap agent inside a training process; returns the agent.

    Needs the ``[server]`` extra (torch); the rest of this package does not,
    so the server is imported only here. See
    ``layertap.server.train.agent.attach`` for the options and docs/training.md.

    >>> with layertap.attach(model, optimizer) as agent:  # doctest: +SKIP
    ...     train(model, optimizer)  # clients connect to agent.port
    """
    try:
        agent_module = _importlib.import_module("layertap.server.train.agent")
    except ImportError as exc:
        raise ImportError("layertap.attach needs the server extra: pip install 'layertap[server]'") from exc
    return agent_module.attach(model, optimizer, **options)

__all__ = [
    # client
    "Client",
    "attach",
    "Fleet",
    "FleetResult",
    "FleetItem",
    "FleetError",
    "FleetStream",
    "Incidents",
    "Incident",
    "IncidentInfo",
    "SummaryStream",
    "TapHandle",
    "Generation",
    # errors
    "LayertapError",
    "NotFound",
    "LayerNotFound",
    "InvalidArgument",
    "AlreadyExists",
    "ResourceExhausted",
    "CaptureTooLarge",
    "FailedPrecondition",
    "DeadlineExceeded",
    "ServerUnavailable",
    "Unauthenticated",
    "PermissionDenied",
    "ProtocolError",
    "ClientClosed",
    # results
    "ModelMetadata",
    "TensorSpec",
    "LayerInfo",
    "ServerStats",
    "TapSpec",
    "Triggers",
    "TapInfo",
    "TapEvent",
    "Summary",
    "BaselineInfo",
    "DriftThresholds",
    "LayerDrift",
    "Explanation",
    "SkippedOutput",
    "GenerationStep",
    "GeneratedToken",
    "StepCapture",
    "GenerationResult",
    # type aliases of public signatures
    "ReducerSpec",
    "Prompt",
    "Structured",
    "__version__",
]
# The reducer results (Moments, MinMax, ...) and their ReducerResult alias: adding a
# result kind to the table (layertap._results) exports its dataclass here.
__all__ += _results.__all__
