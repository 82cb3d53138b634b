"""The torch_xla SPMD backend: ``backend.py`` (registered as ``"xla"`` when imported) and
``env.py`` (the CPU emulation, set up before torch_xla starts). Importing this package imports
neither torch_xla nor the backend."""
