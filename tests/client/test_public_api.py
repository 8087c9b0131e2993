"""The public surface of `layertap` only changes on purpose."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import layertap

pytestmark = pytest.mark.e2e

EXPECTED_ALL = {
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
    "ModelMetadata",
    "TensorSpec",
    "LayerInfo",
    "ServerStats",
    "TapSpec",
    "Triggers",
    "TapInfo",
    "TapEvent",
    "Summary",
    "Moments",
    "MinMax",
    "AbsMax",
    "ZeroFraction",
    "Nonfinite",
    "Norm",
    "Histogram",
    "Quantiles",
    "PerChannel",
    "Latency",
    "Logits",
    "BaselineInfo",
    "DriftThresholds",
    "LayerDrift",
    "Explanation",
    "SkippedOutput",
    "Generation",
    "GenerationStep",
    "GeneratedToken",
    "StepCapture",
    "GenerationResult",
    "Prompt",
    "ReducerSpec",
    "ReducerResult",
    "Structured",
    "__version__",
}


def test_exported_names_are_pinned() -> None:
    assert set(layertap.__all__) == EXPECTED_ALL
    assert len(layertap.__all__) == len(EXPECTED_ALL)
    for name in layertap.__all__:
        assert hasattr(layertap, name), f"__all__ lists {name!r}, which layertap does not define"
    # Nothing public leaks past __all__ (submodules such as layertap.cli aside).
    public = {n for n, v in vars(layertap).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public <= EXPECTED_ALL, f"public but not in __all__: {sorted(public - EXPECTED_ALL)}"


def test_version_matches_distribution() -> None:
    from importlib.metadata import version

    assert layertap.__version__ == version("layertap")


def test_error_hierarchy() -> None:
    errors = [layertap.LayerNotFound, layertap.CaptureTooLarge, layertap.ClientClosed, layertap.AlreadyExists,
              layertap.Unauthenticated, layertap.PermissionDenied]
    assert all(issubclass(e, layertap.LayertapError) for e in errors)
    assert issubclass(layertap.LayerNotFound, layertap.NotFound)
    assert issubclass(layertap.CaptureTooLarge, layertap.ResourceExhausted)
    assert issubclass(layertap.ClientClosed, RuntimeError)
    assert issubclass(layertap.InvalidArgument, ValueError)


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_import_does_not_pull_torch_or_server() -> None:
    _run(
        "import layertap, layertap.cli, sys; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert not any(m.startswith('layertap.server') for m in sys.modules), 'server imported'"
    )


def test_attach_without_torch_names_the_extra() -> None:
    # The thin client imports without torch; only attach() needs the server extra.
    _run(
        "import sys; sys.modules['torch'] = None\n"
        "import layertap\n"
        "try:\n"
        "    layertap.attach(object())\n"
        "except ImportError as e:\n"
        "    assert \"pip install 'layertap[server]'\" in str(e), e\n"
        "else:\n"
        "    raise AssertionError('expected ImportError')\n"
    )


def test_client_works_when_torch_is_missing() -> None:
    # Hide torch as if the base install had no [server] extra.
    _run(
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, layertap\n"
        "from layertap import _codec\n"
        "t = _codec.encode_tensor(np.ones(3, np.float32))\n"
        "assert _codec.decode_tensor(t).sum() == 3\n"
        "try:\n"
        "    _codec.decode_tensor(t, as_torch=True)\n"
        "except ImportError as e:\n"
        "    assert 'needs PyTorch' in str(e)\n"
        "else:\n"
        "    raise AssertionError('expected ImportError')\n"
    )


def _mentions_protobuf(hint: object) -> bool:
    if isinstance(hint, type):
        return hint.__module__.startswith("layertap.v1") or "google.protobuf" in hint.__module__
    return any(_mentions_protobuf(arg) for arg in typing.get_args(hint))


def test_no_protobuf_types_in_public_signatures() -> None:
    for name in layertap.__all__:
        obj = getattr(layertap, name)
        if not isinstance(obj, type):
            continue
        # Every class of the MRO that layertap defines: Client's methods live in mixins too.
        own = [c for c in obj.__mro__ if c.__module__.startswith("layertap")]
        hinted = [obj] + [
            member
            for cls in own
            for key, member in vars(cls).items()
            if callable(member) and (not key.startswith("_") or key == "__init__")
        ]
        for target in hinted:
            try:
                hints = typing.get_type_hints(target)
            except TypeError:
                continue
            for key, hint in hints.items():
                assert not _mentions_protobuf(hint), f"{name}.{key}: {hint}"
        if dataclasses.is_dataclass(obj):
            assert obj.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_package_ships_py_typed() -> None:
    assert (Path(layertap.__file__).parent / "py.typed").exists()
