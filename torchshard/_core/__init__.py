"""torchshard's pure core: values and maths that need no runtime.

Partition specs, the ``Mesh`` value and its thread-local context, the topology (with its
provider slot), ``NamedSharding`` and the index maths, host plans, trees, partitions,
``TensorSpec``, the layout description, the agreement descriptions, deprecations and every
exception type. Standard library, numpy and optree only: no torch, no torch_xla, no
torch.distributed (``tests/test_layers.py`` proves it). The core reaches a runtime only through
the slots in ``runtime.py`` (and a drawer slot in ``layout.py``), which the layers above fill
when they are imported; it never imports them.
"""
