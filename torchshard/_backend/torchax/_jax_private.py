"""Every private JAX name the torchax backend uses, imported here once, with the versions checked.

JAX's underscore names change between releases, so no other torchshard module imports one:
they call the functions below, and a change in a new JAX release is fixed in this one file.
Each entry says which JAX versions it was checked on.

- ``jax._src.distributed.global_state.client``: the coordination service's client that
  ``jax.distributed.initialize`` made (``None`` before it, or on one process). Its
  ``key_value_set(key, value)`` and ``blocking_key_value_get(key, timeout_in_ms)`` are the job's
  key-value store (JAX's own ``multihost_utils`` and compilation cache use them). Checked on
  jax 0.10.2: a ``get`` past its timeout raises ``JaxRuntimeError`` ("DEADLINE_EXCEEDED").
"""

from __future__ import annotations

from typing import Any


def coordination_client() -> Any:
    """The client of JAX's coordination service (``None``: ``jax.distributed`` is not
    initialised). Checked on jax 0.10.2."""
    from jax._src import distributed

    return distributed.global_state.client
