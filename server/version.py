"""Version strings reported by the server (build info, ``GetServerStats``).

One place, so the gRPC stats and the ``layertap_build_info`` series never
disagree.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["server_version", "torch_version"]


def server_version() -> str:
    """The installed layertap distribution's version; ``"0+unknown"`` from a source tree."""
    try:
        return version("layertap")
    except PackageNotFoundError:  # running from a source tree
        return "0+unknown"


def torch_version() -> str:
    """``torch.__version__``, or ``"none"`` where torch is not installed (a thin install)."""
    try:
        import torch  # noqa: PLC0415 - a thin install has no torch
    except ImportError:
        return "none"
    return str(torch.__version__)
