"""Data-parallel training of a small MLP, fed by a DataLoader with workers through torchshard.

The readable version of `python -m torchshard demo`: a DataLoader with worker processes reads
this host's shard of the dataset (host_sampler), GlobalBatchLoader turns each host batch into a
global batch split over all 8 devices of the (4, 2) mesh on a background thread, and the step
runs on torch_xla SPMD with replicated parameters.

Run: python examples/train_mlp.py [--steps 300]

Everything at module level is safe to re-import: the DataLoader workers are started with the
"forkserver" method, which imports this file (as __mp_main__) to find the dataset class, and
must not set up or import torch_xla there.
"""

import argparse
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import torchshard as ts


class Synthetic(Dataset):
    """32 Gaussian features; the label is the argmax of a fixed random linear teacher."""

    def __init__(self, size, seed=0):
        rng = np.random.default_rng(seed)
        teacher = rng.standard_normal((32, 10)).astype(np.float32)
        self.x = rng.standard_normal((size, 32)).astype(np.float32)
        self.y = (self.x @ teacher).argmax(axis=1)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}  # numpy only: workers never touch XLA


def main(steps):
    import torch_xla
    import torch_xla.core.xla_model as xm

    mesh = ts.create_device_mesh((4, 2), ("data", "model"))
    dataset = Synthetic(64 * 256)
    # One host here; on a pod every host passes its own feed config (or an InputDispatcher).
    sampler = ts.host_sampler(dataset, {"num_shards": ts.process_count(), "shard_index": 0})
    host_loader = DataLoader(
        dataset,
        batch_size=256,
        sampler=sampler,
        drop_last=True,  # every batch must have the same shape
        num_workers=2,
        multiprocessing_context="forkserver",
        persistent_workers=True,
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    ).to(torch_xla.device())  # parameters replicated on every device
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    step, epoch, losses = 0, 0, []
    t0 = time.perf_counter()
    with mesh, ts.GlobalBatchLoader(host_loader, prefetch=2) as loader:
        while step < steps:
            sampler.set_epoch(epoch)
            for batch in loader:  # batch["x"]: [256, 32], split over the 8 devices
                loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
                optimizer.zero_grad()
                loss.backward()
                xm.optimizer_step(optimizer)
                torch_xla.sync()
                losses.append(loss)
                step += 1
                if step % 50 == 0 or step == steps:
                    print(f"step {step:4d}  loss {loss.item():.4f}")
                if step == steps:
                    break
            epoch += 1
        xm.wait_device_ops()
        elapsed = time.perf_counter() - t0
        stats = loader.stats
    first, last = losses[0].item(), losses[-1].item()
    print(
        f"loss {first:.3f} -> {last:.3f}; {steps / elapsed:.1f} steps/s (compilation included); "
        f"waited {stats.wait_seconds:.2f} s for input, {stats.bytes / 1e6:.1f} MB transferred"
    )
    return 0 if last < first else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    ts.setup_cpu_emulation(8)  # 8 CPU devices unless a TPU is present; before torch_xla starts
    raise SystemExit(main(args.steps))
