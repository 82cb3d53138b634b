"""The demo on torchax (torchshard._tools.demo_torchax): the MLP trained by JAX from the
loader's torchax batches, in this process, on JAX's 8 CPU devices; its jitted step against
torch's own Adam."""

import numpy as np
import pytest
import torch
from torchax_env import jax8, needs_torchax

pytestmark = needs_torchax


@pytest.fixture(scope="module")
def demo():
    jax8()
    from torchshard._tools import demo_torchax

    return demo_torchax


def test_the_loss_falls(demo):
    r = demo.train(steps=40, batch_size=64, workers=0, log=lambda _: None)
    assert r.loss_fell and np.isfinite(r.last_loss)
    assert r.steps_per_second > 0 and 0 <= r.input_wait_fraction <= 1


def test_one_step_is_torchs_adam_step(demo):
    """The jitted step's loss and new parameters equal torch's own on the same batch."""
    import jax
    import jax.numpy as jnp

    from torchshard._tools._demo_common import mlp

    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(8, 32)
    y = torch.randint(0, 10, (8,))
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    m, v = (jax.tree.map(jnp.zeros_like, params) for _ in range(2))  # donated: two trees
    step = demo.make_step(model, 3e-3)
    new, _, _, loss = step(
        params, m, v, jnp.zeros(()), jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    want = torch.nn.functional.cross_entropy(model(x), y)
    want.backward()
    opt.step()
    assert float(loss) == pytest.approx(want.detach().item(), rel=1e-5)
    for k, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(new[k]), p.detach().numpy(), atol=1e-6)
