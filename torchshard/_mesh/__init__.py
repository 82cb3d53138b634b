"""The mesh as users hold it: ``torchshard.Mesh`` (the core's value bound to its backend),
the context that enters it (``with mesh:``), and building meshes (``create_device_mesh``)."""
