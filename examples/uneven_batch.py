"""A global batch smaller than the device count, with InputDispatcher.

4 examples per step cannot be split over 8 devices. The dispatcher pads each host's "logical"
batch into a "physical" one that divides (8 rows here) and adds a dispatch tensor; the step
drops the padding again with physical_to_logical_batch, so the loss sees exactly the 4 real
examples.

Run: python examples/uneven_batch.py
"""

import numpy as np

import torchshard as ts


def batches(n, rows):
    for i in range(n):
        ids = np.arange(rows, dtype=np.int64) + i * rows
        yield {"id": ids, "x": np.repeat(ids[:, None], 3, axis=1).astype(np.float32)}


def main():
    import torch_xla

    mesh = ts.create_device_mesh((8,), ("data",))
    with mesh:
        dispatcher = ts.InputDispatcher(4)  # global logical batch 4, one host
        print(
            f"logical batch {dispatcher.feed_logical_batch_size} per host -> physical "
            f"{dispatcher.feed_physical_batch_size}, sharded {dispatcher.partition_spec}"
        )
        loader = ts.GlobalBatchLoader(batches(3, rows=4), dispatcher=dispatcher)
        for step, physical in enumerate(loader):
            logical = dispatcher.physical_to_logical_batch(physical)  # in the step
            loss = (logical["x"] * 2).sum()
            torch_xla.sync()
            got = ts.replicate_to_local_data(logical["id"]).tolist()
            print(
                f"step {step}: physical rows {physical['x'].shape[0]}, logical ids {got}, "
                f"loss {loss.item():.0f}"
            )
            assert got == list(range(4 * step, 4 * step + 4))
    return 0


if __name__ == "__main__":
    ts.setup_cpu_emulation(8)
    raise SystemExit(main())
