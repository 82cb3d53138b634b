"""The runtimes behind torchshard, and the boundary they implement.

``protocols.py`` says what a runtime implements (a ``Backend`` record of a few protocols);
``registry.py`` holds the records and the one look-up (``lookup``); each runtime is a package
of its own: ``xla/`` (torch_xla SPMD, and its CPU emulation) and ``dtensor/``
(torch.distributed DTensor: meshes, devices, staging, bounded collectives). Importing this
package imports no runtime.
"""
