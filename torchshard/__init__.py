"""torchshard: per-host batches to global sharded PyTorch tensors, and back.

A port of axlearn's input-sharding functions to PyTorch, on torch_xla SPMD or on
torch.distributed DTensor (the mesh chooses).
Only this module (and ``torchshard.testing``, ``torchshard.data``) is public; it only re-exports.
The layers under it (``docs/design.md``): ``_core`` (pure values and maths) <- ``_backend`` (the
registry and the runtimes) <- the operations (``_host_to_global``, ``_readback``, ...) <-
``data``, ``testing`` <- this module <- ``_tools`` (command line, demo, benchmarks).
"""

from torchshard._backend.xla_env import setup_cpu_emulation as setup_cpu_emulation
from torchshard._constraint import maybe_shard as maybe_shard
from torchshard._constraint import with_sharding_constraint as with_sharding_constraint
from torchshard._core.agreement import set_agreement_check as set_agreement_check
from torchshard._core.agreement import set_value_check as set_value_check
from torchshard._core.errors import CollectiveError as CollectiveError
from torchshard._core.errors import EmulationError as EmulationError
from torchshard._core.errors import IndivisibleError as IndivisibleError
from torchshard._core.errors import NoMeshError as NoMeshError
from torchshard._core.errors import NonUniformShardingError as NonUniformShardingError
from torchshard._core.errors import NoProcessGroupError as NoProcessGroupError
from torchshard._core.errors import ProcessDisagreementError as ProcessDisagreementError
from torchshard._core.errors import ShardingError as ShardingError
from torchshard._core.errors import TreeStructureError as TreeStructureError
from torchshard._core.errors import UnsupportedPartitionError as UnsupportedPartitionError
from torchshard._core.layout import LayoutBlock as LayoutBlock
from torchshard._core.layout import ShardingLayout as ShardingLayout
from torchshard._core.layout import describe_layout as describe_layout
from torchshard._core.mesh import Mesh as Mesh
from torchshard._core.mesh import current_mesh as current_mesh
from torchshard._core.partition import complete_partition_spec_tree as complete_partition_spec_tree
from torchshard._core.partition import data_partition_type_to_spec as data_partition_type_to_spec
from torchshard._core.partition import input_partition_spec as input_partition_spec
from torchshard._core.sharding import NamedSharding as NamedSharding
from torchshard._core.spec import DataPartitionType as DataPartitionType
from torchshard._core.spec import P as P
from torchshard._core.spec import PartitionSpec as PartitionSpec
from torchshard._core.tensor_spec import TensorSpec as TensorSpec
from torchshard._core.topology import process_count as process_count
from torchshard._core.topology import process_index as process_index
from torchshard._core.version import __version__ as __version__
from torchshard._dispatch import (
    PHYSICAL_TO_LOGICAL_DISPATCH_KEY as PHYSICAL_TO_LOGICAL_DISPATCH_KEY,
)
from torchshard._dispatch import dispatch_input_batch as dispatch_input_batch
from torchshard._host_to_global import host_to_global_array as host_to_global_array
from torchshard._host_to_global import host_to_global_device_array as host_to_global_device_array
from torchshard._host_to_global import host_to_global_specs as host_to_global_specs
from torchshard._input_dispatcher import InputDispatcher as InputDispatcher
from torchshard._mesh_build import HybridMeshShape as HybridMeshShape
from torchshard._mesh_build import create_device_mesh as create_device_mesh
from torchshard._mesh_build import infer_mesh_shape as infer_mesh_shape
from torchshard._readback import global_to_host_array as global_to_host_array
from torchshard._readback import replicate_to_local_data as replicate_to_local_data
from torchshard._spmd_input_dispatcher import SpmdInputDispatcher as SpmdInputDispatcher
from torchshard._visualize import visualize_sharding as visualize_sharding
from torchshard.data._collate import sharded_collate as sharded_collate
from torchshard.data._loader import GlobalBatchLoader as GlobalBatchLoader
from torchshard.data._sampler import host_sampler as host_sampler

__all__ = [
    "CollectiveError",
    "DataPartitionType",
    "EmulationError",
    "GlobalBatchLoader",
    "HybridMeshShape",
    "IndivisibleError",
    "InputDispatcher",
    "LayoutBlock",
    "Mesh",
    "NamedSharding",
    "NoMeshError",
    "NoProcessGroupError",
    "NonUniformShardingError",
    "P",
    "PHYSICAL_TO_LOGICAL_DISPATCH_KEY",
    "PartitionSpec",
    "ProcessDisagreementError",
    "ShardingError",
    "ShardingLayout",
    "SpmdInputDispatcher",
    "TensorSpec",
    "TreeStructureError",
    "UnsupportedPartitionError",
    "complete_partition_spec_tree",
    "create_device_mesh",
    "current_mesh",
    "data_partition_type_to_spec",
    "describe_layout",
    "dispatch_input_batch",
    "global_to_host_array",
    "host_sampler",
    "host_to_global_array",
    "host_to_global_device_array",
    "host_to_global_specs",
    "infer_mesh_shape",
    "input_partition_spec",
    "maybe_shard",
    "process_count",
    "process_index",
    "replicate_to_local_data",
    "set_agreement_check",
    "set_value_check",
    "setup_cpu_emulation",
    "sharded_collate",
    "visualize_sharding",
    "with_sharding_constraint",
]
assert sorted(__all__) == __all__
