"""``python -m torchshard demo --backend torchax``: the demo's training on torchax (PyTorch on
JAX), in one JAX process.

The same MLP, data and input path as the torch_xla demo (``demo.py``): a ``DataLoader`` with
worker processes reads this host's shard (``host_sampler``), and ``GlobalBatchLoader`` turns its
batches into global batches on the mesh ``(N / 2, 2)`` of JAX's N devices (``--devices N`` CPU
devices, set through ``XLA_FLAGS`` before JAX starts; a TPU's chips), split over every device.
The batches are torchax tensors; the step is the model's own torch code run by JAX: the loss
is ``torch.func.functional_call`` of the model, made a JAX function by
``torchax.interop.jax_view``, differentiated by ``jax.value_and_grad`` and jitted with Adam, the
parameters replicated. Several hosts are several JAX processes (``jax.distributed``), each
running this with its own loader: the demo is one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from torchshard._tools._demo_common import (
    STEPS_PER_EPOCH,
    Result,
    SyntheticClassification,
    _input_wait,
    _mean,
    host_loader,
    mesh_shape,
    mlp,
)

BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults


def device_count() -> int:
    """JAX's devices (``--devices`` CPU devices, or a TPU's chips)."""
    from torchshard._backend.torchax.runtime import jax, torchax

    torchax()  # the backend's check that torchax imports (MissingDependencyError)
    return len(jax().devices())


def make_step(model: torch.nn.Module, lr: float) -> Callable[..., Any]:
    """The jitted training step ``(params, m, v, t, x, y) -> (params, m, v, loss)`` on JAX
    arrays: the model's loss through torchax, its gradient by JAX, an Adam update."""
    import jax
    import jax.numpy as jnp
    import torchax.interop

    def loss_of(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        logits = torch.func.functional_call(model, params, (x,))
        return torch.nn.functional.cross_entropy(logits, y)

    loss_fn = torchax.interop.jax_view(loss_of)
    b1, b2 = BETAS

    def step(params: Any, m: Any, v: Any, t: Any, x: Any, y: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        t = t + 1
        m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1**t, 1 - b2**t
        params = jax.tree.map(
            lambda p, a, b: p - lr * (a / c1) / (jnp.sqrt(b / c2) + EPS), params, m, v
        )
        return params, m, v, loss

    return jax.jit(step, donate_argnums=(0, 1, 2))


def train(
    *,
    steps: int = 300,
    batch_size: int = 256,
    workers: int = 2,
    lr: float = 3e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Result:
    """Trains the MLP for ``steps`` steps on torchax; returns the losses and the throughput."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import torchshard as ts

    devices = device_count()
    torch.manual_seed(seed)
    mesh = ts.create_device_mesh(mesh_shape(devices), ("data", "model"), backend="torchax")
    dataset = SyntheticClassification(STEPS_PER_EPOCH * batch_size, seed=seed)
    with mesh:
        feed = ts.feed_read_config(ts.P(mesh.axis_names), mesh=mesh)
    sampler = ts.host_sampler(dataset, feed, seed=seed)
    loader_ = host_loader(dataset, batch_size, sampler, workers)
    log(
        f"mesh {dict(mesh.shape)} of JAX's {devices} {jax.devices()[0].platform} device(s) "
        f"(torchax), {workers} DataLoader worker(s){' (forkserver)' if workers else ''}, "
        f"global batch {batch_size}, {steps} steps"
    )
    model = mlp()
    replicated = jax.sharding.NamedSharding(mesh.jax_mesh, jax.sharding.PartitionSpec())
    params = {
        k: jax.device_put(np.asarray(p.detach().numpy()), replicated)
        for k, p in model.named_parameters()
    }
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    t = jnp.zeros((), jnp.float32)
    step_fn = make_step(model, lr)
    every = max(1, steps // 10)
    warmup = min(3, steps - 1)
    losses: list[float] = []
    pending: list[Any] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(mesh)
        loader = stack.enter_context(ts.GlobalBatchLoader(loader_))
        t_start = time.perf_counter()
        t_warm, step, epoch = t_start, 0, 0
        while step < steps:
            sampler.set_epoch(epoch)
            for batch in loader:
                params, m, v, loss = step_fn(params, m, v, t, batch["x"].jax(), batch["y"].jax())
                t = t + 1
                pending.append(loss)
                step += 1
                if step == warmup:
                    jax.block_until_ready(loss)
                    t_warm = time.perf_counter()
                if step % every == 0 or step == steps:
                    losses += [float(x) for x in pending]
                    pending.clear()
                    elapsed = time.perf_counter() - t_warm
                    done = step - warmup
                    frac = _input_wait(loader.stats)
                    rate = f"{done / elapsed:6.1f} steps/s" if done > 0 else " warming up"
                    log(f"step {step:>5}/{steps}  loss {losses[-1]:.4f}  {rate}  {frac}")
                if step == steps:
                    break
            epoch += 1
        jax.block_until_ready(params)
        elapsed = time.perf_counter() - t_warm
        stats = loader.stats
    timed = max(steps - warmup, 1)
    window = max(1, min(10, steps // 5))
    return Result(
        first_loss=_mean(losses[:window]),
        last_loss=_mean(losses[-window:]),
        steps_per_second=timed / elapsed,
        examples_per_second=timed * batch_size / elapsed,
        input_wait_fraction=stats.input_wait_fraction,
        warmup_seconds=t_warm - t_start,
        warmup_wait_seconds=stats.warmup_wait_seconds,
    )
