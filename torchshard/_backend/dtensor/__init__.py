"""The torch.distributed DTensor backend: ``backend.py`` (registered as ``"dtensor"`` when
imported), ``mesh.py`` (DeviceMeshes), ``device.py`` (the mesh's device on this process),
``staging.py`` (pinned host <-> accelerator copies), ``collective.py`` (bounded, named
cross-process steps) and ``_torch_private.py`` (every private torch name torchshard uses).
Importing this package imports none of them."""
