"""Exception types and the helpers that format torchshard's error messages.

Every error about user input names *where* (the argument and tree path, written as code,
e.g. ``host_arrays['x'][0]``), *what was expected* and *what was found*, and, where one
exists, the fix. Standard library only.
"""

from __future__ import annotations


class ShardingError(ValueError):
    """Base class of torchshard's value errors about shardings, meshes and layouts."""


class IndivisibleError(ShardingError):
    """A dimension does not divide evenly by the number of shards it is split into."""


class NonUniformShardingError(ShardingError):
    """Raised when a sharding is not uniform across processes along some dimension.

    Every process must hold the same number of distinct slices along a dimension, and the
    distinct per-process sets of slices must partition all slices; otherwise the global shape
    cannot be inferred from a process's local block.
    """


class NoMeshError(ShardingError):
    """A function that needs a mesh was called outside ``with mesh:``."""


class TreeStructureError(ShardingError):
    """Two trees that must match (or one be a prefix of the other) do not."""


class NoProcessGroupError(ShardingError):
    """A backend that runs one process per device (DTensor) was used before
    ``torch.distributed.init_process_group``."""


class ProcessDisagreementError(ShardingError):
    """The processes of a run passed different tree structures, shapes or dtypes to a call
    that must see the same ones on every process (raised on every process)."""


def at(where: str, message: str) -> str:
    """Prefixes ``message`` with the tree path ``where`` (``"host_arrays['x']: ..."``)."""
    return f"{where}: {message}" if where else message
