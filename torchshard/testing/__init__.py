"""Test helpers: emulate multi-host SPMD in one process on CPU, and assert on layouts.

The pytest plugin (``torchshard.testing._spmd``, registered by its gate, the ``pytest11`` entry
point ``torchshard``, when a project asks for it) sets up the CPU-emulated devices and provides
the ``spmd_devices``, ``make_mesh`` and ``virtual_hosts`` fixtures and the
``@pytest.mark.spmd(devices=[...])`` marker.
"""

from torchshard.testing._asserts import assert_global_equal as assert_global_equal
from torchshard.testing._asserts import assert_sharded as assert_sharded
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
    "assert_global_equal",
    "assert_sharded",
    "global_batch_loader_per_host",
    "global_to_host_array_per_host",
    "host_to_global_array_per_host",
    "make_virtual_topology",
    "virtual_hosts",
]
assert sorted(__all__) == __all__
