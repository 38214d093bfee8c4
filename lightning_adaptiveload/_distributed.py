"""The world size and rank of this process, in one place.

torch is not imported here: a process group can only exist after `torch.distributed` was
imported, so a caller that plans without torch (scheduling/) never pays for importing it.
"""
from __future__ import annotations

import sys


def is_distributed() -> bool:
    """True when torch.distributed has an initialised default process group."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def world_size_and_rank(group=None) -> tuple[int, int]:
    """(world size, rank) in `group` (default: the default process group), or (1, 0) without an
    initialised process group."""
    if not is_distributed():
        return 1, 0
    dist = sys.modules["torch.distributed"]
    return dist.get_world_size(group), dist.get_rank(group)
