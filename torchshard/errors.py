"""torchshard's exception types.

Every error about user input names *where* (the argument and tree path, written as code,
e.g. ``host_arrays['x'][0]``), *what was expected* and *what was found*, and, where one
exists, the fix. ``ShardingError`` (a ``ValueError``) is the base of the value errors and is
also at the top level (``torchshard.ShardingError``); the others are here::

    ValueError
      ShardingError                 shardings, meshes, layouts
        IndivisibleError            a dimension that does not divide by its shard count
        NonUniformShardingError     processes that hold different numbers of blocks
        NoMeshError                 a call that needs a mesh, outside ``with mesh:``
        TreeStructureError          trees that must match (or be prefixes) do not
        NoProcessGroupError         a DTensor mesh before ``init_process_group``
        ProcessDisagreementError    processes that passed different calls (every process)
      WorkerProcessError            ``sharded_collate`` in a DataLoader worker process
    TypeError, NotImplementedError
      UnsupportedPartitionError     a partition that is no spec, partition type or tree
    RuntimeError
      CollectiveError               a cross-process step that did not complete in time
      EmulationError                torch_xla started with another device count
    ImportError
      MissingDependencyError        an optional dependency (the message names the extra)
    UserWarning
      Float64Warning                float64 data on a torch_xla mesh (TPUs have none; once)
    Exception
      ChildFailedError              a ``@pytest.mark.spmd`` item's child process failed
"""

from torchshard._core.errors import ChildFailedError as ChildFailedError
from torchshard._core.errors import CollectiveError as CollectiveError
from torchshard._core.errors import EmulationError as EmulationError
from torchshard._core.errors import Float64Warning as Float64Warning
from torchshard._core.errors import IndivisibleError as IndivisibleError
from torchshard._core.errors import MissingDependencyError as MissingDependencyError
from torchshard._core.errors import NoMeshError as NoMeshError
from torchshard._core.errors import NonUniformShardingError as NonUniformShardingError
from torchshard._core.errors import NoProcessGroupError as NoProcessGroupError
from torchshard._core.errors import ProcessDisagreementError as ProcessDisagreementError
from torchshard._core.errors import ShardingError as ShardingError
from torchshard._core.errors import TreeStructureError as TreeStructureError
from torchshard._core.errors import UnsupportedPartitionError as UnsupportedPartitionError
from torchshard._core.errors import WorkerProcessError as WorkerProcessError

__all__ = [
    "ChildFailedError",
    "CollectiveError",
    "EmulationError",
    "Float64Warning",
    "IndivisibleError",
    "MissingDependencyError",
    "NoMeshError",
    "NoProcessGroupError",
    "NonUniformShardingError",
    "ProcessDisagreementError",
    "ShardingError",
    "TreeStructureError",
    "UnsupportedPartitionError",
    "WorkerProcessError",
]
assert sorted(__all__) == __all__
