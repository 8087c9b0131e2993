"""Which rank of a ``torchrun`` job this process is, from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Rank:
    """``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (0, 0, 1 outside a distributed job)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Rank:
        """Read the variables torchrun sets.

        Raises:
            ValueError: A variable is not a non-negative integer (it is named).
        """
        env = os.environ if env is None else env

        def read(name: str, default: int) -> int:
            text = env.get(name, "").strip()
            if not text:
                return default
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not an integer") from None
            if value < 0:
                raise ValueError(f"{name}={value} is negative")
            return value

        rank = cls(read("RANK", 0), read("LOCAL_RANK", 0), read("WORLD_SIZE", 1))
        if rank.rank >= rank.world_size:
            raise ValueError(f"RANK={rank.rank} is not below WORLD_SIZE={rank.world_size}")
        return rank

    def port(self, base: int | None) -> int | None:
        """The port this rank listens on: ``base + LOCAL_RANK``; 0 (any free port) and None stay."""
        if not base:
            return base
        return base + self.local_rank
