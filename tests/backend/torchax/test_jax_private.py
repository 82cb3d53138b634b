"""The private JAX names the torchax backend uses (torchshard._backend.torchax._jax_private):
each still where it was found, on the JAX installed."""

from __future__ import annotations

from torchax_env import jax8, needs_torchax

pytestmark = needs_torchax


def test_the_coordination_client_is_none_before_jax_distributed():
    jax8()
    from jax._src import distributed

    from torchshard._backend.torchax._jax_private import coordination_client

    assert hasattr(distributed.global_state, "client")
    assert coordination_client() is None  # this process never called jax.distributed
