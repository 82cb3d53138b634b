"""torchshard's pure core: values and maths that need no runtime.

Partition specs, the ``Mesh`` value (``mesh.py``) and the per-thread mesh context
(``context.py``, a pure stack), the topology value and its emulations (``topology.py``),
``NamedSharding`` and the index maths, host blocks, trees, partitions, ``TensorSpec``, the
layout description, the agreement descriptions, the shared argument checks, deprecations and
every exception type. Standard library, numpy and optree only: no torch, no torch_xla, no
torch.distributed (``tests/cross/test_layers.py`` proves it). The core reaches no runtime: a
bound mesh (``torchshard.Mesh``, a layer above) answers ``Mesh._runtime_topology``, and
``ShardingLayout.save_png`` calls the drawer ``torchshard._visualize`` installs.
"""
