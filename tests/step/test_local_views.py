"""to_local / to_submesh (torchshard._step.local_views) in one process: every leaf that is no
DTensor passes through unchanged (plain tensors, numpy arrays, Python values, XLA tensors: a
torch_xla SPMD step takes the global tensors), trees keep their types, and a bad sub-mesh is
refused before any leaf is looked at. The DTensor side runs on gloo processes
(tests/backend/dtensor/test_views.py) and in the stacks' training (tests/cross/test_stacks.py)."""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._backend.registry import lookup

Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    meta: dict


def _tree():
    t = torch.arange(6.0).reshape(2, 3)
    return {
        "t": t,
        "arr": np.ones(3),
        "n": 3,
        "s": "text",
        "none": None,
        "pair": Pair(t, [t, 1.5]),
        "batch": Batch(t, {"k": t}),
    }


def test_to_local_leaves_every_non_dtensor_leaf_as_it_is():
    tree = _tree()
    out = ts.to_local(tree)
    assert out is not tree and type(out) is dict  # a new tree
    assert out["t"] is tree["t"] and out["arr"] is tree["arr"]
    assert (out["n"], out["s"], out["none"]) == (3, "text", None)
    assert type(out["pair"]) is Pair and out["pair"].a is tree["t"] and out["pair"].b[1] == 1.5
    assert type(out["batch"]) is Batch and out["batch"].meta["k"] is tree["t"]
    assert ts.to_local(tree["t"]) is tree["t"]
    assert ts.to_local(None) is None


def test_the_xla_backend_has_no_local_views():
    # torch_xla's step takes global tensors: its record says so (no views), and to_local needs
    # no no-op member to leave its tensors alone.
    assert lookup("xla").views is None
    assert lookup("dtensor").views is not None
    assert lookup(torch.zeros(1)).views is None  # a plain tensor: the xla record's answer


def test_to_local_leaves_xla_global_tensors_as_they_are(mesh8):
    x = ts.host_to_global_array(np.arange(16.0, dtype=np.float32).reshape(8, 2))
    out = ts.to_local({"x": x, "y": [x]})
    assert out["x"] is x and out["y"][0] is x


@pytest.mark.xla  # an XLA mesh value by default
def test_to_submesh_refuses_what_is_no_sub_mesh():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "to_submesh: submesh must be a torch.distributed DeviceMesh (a sub-mesh of the "
            "DTensors' mesh, e.g. device_mesh['tp']) or a torchshard.Mesh over one, but got str."
        ),
    ):
        ts.to_submesh(_tree(), "tp")
    with pytest.raises(TypeError, match=re.escape("but got NoneType.")):
        ts.to_submesh(_tree(), None)
    xla_mesh = ts.Mesh(np.arange(2), ("tp",))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "to_submesh: submesh Mesh({'tp': 2}) is a mesh of the xla backend, whose step takes "
            "global tensors (there is nothing to re-home); to change a layout in the step use "
            "with_sharding_constraint."
        ),
    ):
        ts.to_submesh(_tree(), xla_mesh)


def test_to_submesh_leaves_non_dtensor_leaves_as_they_are():
    tree = _tree()
    sub = ts.Mesh(np.arange(2), ("tp",), backend="dtensor")
    out = ts.to_submesh(tree, sub)
    assert out["t"] is tree["t"] and out["arr"] is tree["arr"] and out["n"] == 3
    assert type(out["batch"]) is Batch
