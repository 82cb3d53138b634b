"""Every exception type of torchshard, and the helper that prefixes tree paths.

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


class CollectiveError(RuntimeError):
    """A collective torchshard issued across processes did not complete: a process did not
    answer within the default process group's timeout, or a peer was lost. The message names
    torchshard's call (a loader's names the batch) and the ranks that did not answer."""


class UnsupportedPartitionError(TypeError, NotImplementedError):
    """A ``partition`` that is neither a ``DataPartitionType``, a ``PartitionSpec`` nor a tree
    of them (a ``TypeError``; also a ``NotImplementedError``, as axlearn raises)."""


class EmulationError(RuntimeError):
    """torch_xla's runtime already started with another device type or count."""


class WorkerProcessError(ValueError):
    """``sharded_collate`` ran in a DataLoader worker process, where XLA tensors cannot be made."""


class Float64Warning(UserWarning):
    """float64 (or complex128) data placed on a torch_xla mesh: TPUs have no float64 (warned once
    per process; cast on the host, or filter this warning where float64 is meant)."""


class MissingDependencyError(ImportError):
    """An optional dependency needed by the requested feature is not installed."""


class ChildFailedError(Exception):
    """A ``@pytest.mark.spmd`` item's child process reported a failure (or ran nothing); the
    text is the child's report."""


def at(where: object, message: str) -> str:
    """Prefixes ``message`` with the tree path ``where`` (``"host_arrays['x']: ..."``): a str,
    or what formats as one (``tree.LeafPath``: computed here, when the error is made)."""
    return f"{where}: {message}" if where else message


# Users meet these types as ``torchshard.errors.X`` (the public module that re-exports them), so
# tracebacks and reprs name them so (pickling finds them there too).
for _cls in (
    ShardingError,
    IndivisibleError,
    NonUniformShardingError,
    NoMeshError,
    TreeStructureError,
    NoProcessGroupError,
    ProcessDisagreementError,
    CollectiveError,
    UnsupportedPartitionError,
    EmulationError,
    WorkerProcessError,
    MissingDependencyError,
    ChildFailedError,
    Float64Warning,
):
    _cls.__module__ = "torchshard.errors"
del _cls
