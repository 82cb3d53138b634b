"""Test helpers: emulate multi-host SPMD in one process on CPU."""

from torchshard.testing._loader import (
    global_batch_loader_per_host as global_batch_loader_per_host,
)
from torchshard.testing._virtual import (
    global_to_host_array_per_host as global_to_host_array_per_host,
)
from torchshard.testing._virtual import (
    host_to_global_array_per_host as host_to_global_array_per_host,
)
from torchshard.testing._virtual import make_virtual_topology as make_virtual_topology
from torchshard.testing._virtual import virtual_hosts as virtual_hosts

__all__ = [
    "global_batch_loader_per_host",
    "global_to_host_array_per_host",
    "host_to_global_array_per_host",
    "make_virtual_topology",
    "virtual_hosts",
]
