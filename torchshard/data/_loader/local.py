"""``GlobalBatchLoader(..., local=True)``: an epoch whose batches come out as their local
views (``torchshard.to_local``), for steps that compute per process (FSDP2, DDP, torchtitan).

The epoch itself is unchanged: the checks, the agreement between processes and the optional
value check all run on the global batch before its local view is taken (no copy: a DTensor's
local block is its own memory)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchshard._step.local_views import to_local
from torchshard.data._loader.epoch import Epoch, uncopyable


class LocalEpoch(Iterator[Any]):
    """An ``Epoch`` that yields ``to_local(batch)``; ``close`` closes the epoch."""

    def __init__(self, epoch: Epoch) -> None:
        self._epoch = epoch

    def __iter__(self) -> LocalEpoch:
        return self

    def __copy__(self) -> LocalEpoch:
        raise TypeError(uncopyable("copy.copy", "an iterator of a GlobalBatchLoader"))

    def __deepcopy__(self, memo: dict[int, Any]) -> LocalEpoch:
        raise TypeError(uncopyable("copy.deepcopy", "an iterator of a GlobalBatchLoader"))

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TypeError(uncopyable("pickle.dumps", "an iterator of a GlobalBatchLoader"))

    def __next__(self) -> Any:
        return to_local(next(self._epoch))

    def close(self) -> None:
        """Stops the epoch's thread and frees its queued batches (idempotent)."""
        self._epoch.close()
