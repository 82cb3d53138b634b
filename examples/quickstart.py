"""Quick start: one host's batch -> global sharded tensors on an 8-device CPU mesh -> back.

Run: python examples/quickstart.py
"""

import numpy as np
import torch

import torchshard as ts

ts.setup_cpu_emulation(8)  # before torch_xla starts; a no-op on a TPU host


def main() -> None:
    mesh = ts.create_device_mesh((4, 2), ("data", "model"))
    batch = {
        "image": np.random.rand(16, 8).astype(np.float32),
        "label": np.arange(16),
    }
    with mesh:
        global_batch = ts.host_to_global_array(batch, partition=ts.P("data"))
        x = global_batch["image"]
        print("global", tuple(x.shape), x.device, "mesh", dict(mesh.shape))
        print("rows per device:", ts.NamedSharding(mesh, ts.P("data")).shard_shape(x.shape))
        back = ts.global_to_host_array(global_batch)
    assert torch.equal(back["image"], torch.from_numpy(batch["image"]))
    assert torch.equal(back["label"], torch.from_numpy(batch["label"]))
    print("round trip is bit-exact")


if __name__ == "__main__":
    main()
