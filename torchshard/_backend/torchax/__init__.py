"""The torchax backend: PyTorch on JAX (torch tensors that are ``jax.Array``s underneath).
Imported only when a mesh names it (``backend.py`` registers it)."""
