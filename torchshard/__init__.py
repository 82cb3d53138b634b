"""torchshard: each host's block of a batch -> global sharded PyTorch tensors over a device
mesh, fed from a ``DataLoader``, and back; on torch_xla SPMD or torch.distributed DTensor (the
mesh chooses).

This module only re-exports the everyday names; ``torchshard.data``, ``torchshard.testing`` and
``torchshard.errors`` (the exception types; ``ShardingError``, their base, is here too) are the
other public modules. The names marked "axlearn compatibility" below keep axlearn's API for
code ported from it; new code has a plainer way (each one's docstring names it). The layers
under this module (``docs/design.md``): ``_core`` (pure values and maths) <- ``_backend`` (the
runtimes) <- ``_mesh`` <- ``_place`` (host <-> global) <- ``_step`` (in the step),
``_visualize`` <- ``data``, ``testing`` <- this module <- ``_tools``.
"""

import warnings as _warnings
from typing import Any as _Any

from torchshard import errors as errors
from torchshard._backend.xla.env import setup_cpu_emulation as setup_cpu_emulation
from torchshard._core.agreement import call_stream as call_stream
from torchshard._core.agreement import set_agreement_check as set_agreement_check
from torchshard._core.agreement import set_agreement_deferred as set_agreement_deferred
from torchshard._core.agreement import set_value_check as set_value_check
from torchshard._core.context import current_mesh as current_mesh
from torchshard._core.context_parallel import (
    context_parallel_order as context_parallel_order,
)
from torchshard._core.context_parallel import (
    context_parallel_positions as context_parallel_positions,
)
from torchshard._core.context_parallel import head_tail_order as head_tail_order
from torchshard._core.errors import ShardingError as ShardingError
from torchshard._core.feed import feed_read_config as feed_read_config
from torchshard._core.feed import feed_slices as feed_slices
from torchshard._core.layout import LayoutBlock as LayoutBlock
from torchshard._core.layout import ShardingLayout as ShardingLayout
from torchshard._core.layout import describe_layout as describe_layout
from torchshard._core.partition import (
    complete_partition_spec_tree as complete_partition_spec_tree,
)
from torchshard._core.partition import data_partition_type_to_spec as data_partition_type_to_spec
from torchshard._core.partition import input_partition_spec as input_partition_spec
from torchshard._core.sharding import NamedSharding as NamedSharding
from torchshard._core.spec import DataPartitionType as DataPartitionType
from torchshard._core.spec import P as P
from torchshard._core.spec import PartitionSpec as PartitionSpec
from torchshard._core.tensor_spec import TensorSpec as TensorSpec
from torchshard._core.version import __version__ as __version__
from torchshard._mesh.build import HybridMeshShape as HybridMeshShape
from torchshard._mesh.build import create_device_mesh as create_device_mesh
from torchshard._mesh.build import infer_mesh_shape as infer_mesh_shape
from torchshard._mesh.context import process_count as process_count
from torchshard._mesh.context import process_index as process_index
from torchshard._mesh.mesh import Mesh as Mesh
from torchshard._place.host_to_global import host_to_global_array as host_to_global_array
from torchshard._place.host_to_global import (
    host_to_global_device_array as host_to_global_device_array,
)
from torchshard._place.host_to_global import host_to_global_specs as host_to_global_specs
from torchshard._place.readback import global_to_host_array as global_to_host_array
from torchshard._place.readback import replicate_to_local_data as replicate_to_local_data
from torchshard._step.constraint import maybe_shard as maybe_shard
from torchshard._step.constraint import with_sharding_constraint as with_sharding_constraint
from torchshard._step.dispatch import (
    PHYSICAL_TO_LOGICAL_DISPATCH_KEY as PHYSICAL_TO_LOGICAL_DISPATCH_KEY,
)
from torchshard._step.dispatch import dispatch_input_batch as dispatch_input_batch
from torchshard._step.input_dispatcher import InputDispatcher as InputDispatcher
from torchshard._step.local_views import to_local as to_local
from torchshard._step.local_views import to_submesh as to_submesh
from torchshard._step.spmd_input_dispatcher import SpmdInputDispatcher as SpmdInputDispatcher
from torchshard._visualize.sharding import visualize_sharding as visualize_sharding
from torchshard.data._collate import sharded_collate as sharded_collate
from torchshard.data._loader.loader import GlobalBatchLoader as GlobalBatchLoader
from torchshard.data._sampler import host_sampler as host_sampler
from torchshard.data._stream_shard import stream_shard as stream_shard

# axlearn compatibility: axlearn's names and semantics, for code ported from it; new code has a
# plainer way (PartitionSpecs instead of DataPartitionType, InputDispatcher instead of
# dispatch_input_batch, host_to_global_array instead of its old name, ...).
_COMPATIBILITY = (
    "DataPartitionType",
    "PHYSICAL_TO_LOGICAL_DISPATCH_KEY",
    "complete_partition_spec_tree",
    "data_partition_type_to_spec",
    "dispatch_input_batch",
    "host_to_global_device_array",
    "infer_mesh_shape",
)
"""The names kept for code ported from axlearn (``docs/api``: "axlearn compatibility")."""

__all__ = [
    "DataPartitionType",
    "GlobalBatchLoader",
    "HybridMeshShape",
    "InputDispatcher",
    "LayoutBlock",
    "Mesh",
    "NamedSharding",
    "P",
    "PHYSICAL_TO_LOGICAL_DISPATCH_KEY",
    "PartitionSpec",
    "ShardingError",
    "ShardingLayout",
    "SpmdInputDispatcher",
    "TensorSpec",
    "call_stream",
    "complete_partition_spec_tree",
    "context_parallel_order",
    "context_parallel_positions",
    "create_device_mesh",
    "current_mesh",
    "data_partition_type_to_spec",
    "describe_layout",
    "dispatch_input_batch",
    "errors",
    "feed_read_config",
    "feed_slices",
    "global_to_host_array",
    "head_tail_order",
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
    "set_agreement_deferred",
    "set_value_check",
    "setup_cpu_emulation",
    "sharded_collate",
    "stream_shard",
    "to_local",
    "to_submesh",
    "visualize_sharding",
    "with_sharding_constraint",
]
assert sorted(__all__) == __all__

# The exception types moved to torchshard.errors (0.2): their old top-level names still work,
# with a DeprecationWarning naming the new place.
_MOVED_TO_ERRORS = frozenset(errors.__all__) - {"ShardingError", "Float64Warning"}


def __getattr__(name: str) -> _Any:
    if name in _MOVED_TO_ERRORS:
        _warnings.warn(
            f"torchshard.{name} is deprecated; use torchshard.errors.{name} (the exception types "
            "live in torchshard.errors; torchshard.ShardingError, their base, stays here).",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(errors, name)
    raise AttributeError(f"module 'torchshard' has no attribute {name!r}")
