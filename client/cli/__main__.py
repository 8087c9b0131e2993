"""``python -m layertap.cli``: the same as the ``layertap`` console script."""

from __future__ import annotations

from . import run

if __name__ == "__main__":
    run()
