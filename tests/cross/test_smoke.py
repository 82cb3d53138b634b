import numpy as np
import torch

import torchshard as ts


def test_round_trip(mesh42):
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    g = ts.host_to_global_array({"x": x})
    assert g["x"].shape == (16, 3)
    assert torch.equal(ts.global_to_host_array(g)["x"], torch.from_numpy(x))
