"""Oracles shared by the tests: torch_xla's own shard reports, numpy slicing, conformance data.

Nothing here calls torchshard's index maths: these are the independent answers the tests
compare torchshard with.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import torchshard as ts

# The conformance vectors: data read by the cross-cutting suites, kept beside them.
CONFORMANCE = pathlib.Path(__file__).parent / "cross" / "conformance"
SHARED_CONFORMANCE = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "conformance"

Ranges = tuple[tuple[int, int], ...]

# Every dtype the issue names (written out here, not read from torchshard: an independent list).
DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def load_conformance(name: str) -> dict[str, Any]:
    """One conformance file (``index_maps`` or ``host_layouts``), from ``tests/cross/conformance``
    (the vectors are data, kept beside the suites that read them)."""
    with open(CONFORMANCE / f"{name}.json") as f:
        return json.load(f)


def conformance_mesh(case: Mapping[str, Any]) -> ts.Mesh:
    """The mesh of a conformance case."""
    devices = np.asarray(case["device_ids"]).reshape(case["mesh_shape"])
    return ts.Mesh(devices, tuple(case["axis_names"]))


def conformance_spec(case: Mapping[str, Any]) -> ts.PartitionSpec:
    """The partition spec of a conformance case (JSON lists become axis tuples)."""
    return ts.P(*[tuple(e) if isinstance(e, list) else e for e in case["spec"]])


def as_ranges(slices: Any, shape: Sequence[int]) -> Ranges:
    """``(start, stop)`` per dimension of a tuple of slices, or of ``Ellipsis`` (everything)."""
    if slices is Ellipsis:
        return tuple((0, int(n)) for n in shape)
    out = []
    for s, n in zip(slices, shape, strict=True):
        start, stop, step = s.indices(int(n))
        assert step == 1
        out.append((start, stop))
    return tuple(out)


def index_map_ranges(index_map: Mapping[int, Any], shape: Sequence[int]) -> dict[int, Ranges]:
    """``{device: ranges}`` of a ``devices_indices_map`` result."""
    return {int(d): as_ranges(s, shape) for d, s in index_map.items()}


def device_id(name: str) -> int:
    """``"CPU:3"`` -> 3."""
    return int(name.rsplit(":", 1)[1])


def xla_shards(t: torch.Tensor) -> dict[int, tuple[Ranges, torch.Tensor]]:
    """torch_xla's own report of a global tensor: ``{device: (ranges, data)}``, read with
    ``XLAShardedTensor(t).local_shards`` (padding of uneven shards cropped off the data)."""
    import torch_xla.distributed.spmd as xs

    shape = tuple(t.shape)
    out = {}
    for shard in xs.XLAShardedTensor(t).local_shards:
        ranges = as_ranges(shard.indices, shape)
        crop = tuple(slice(0, b - a) for a, b in ranges)
        out[device_id(shard.shard_device)] = (ranges, shard.data[crop])
    return out


def torch_xla_placement(
    array: np.ndarray | torch.Tensor, mesh: ts.Mesh, spec: Sequence[Any]
) -> dict[int, tuple[Ranges, torch.Tensor]]:
    """Places ``array`` with torch_xla's own ``mark_sharding`` and reports its shards.

    The spec is padded with ``None`` to the array's rank, as torch_xla requires.
    """
    import torch_xla
    import torch_xla.distributed.spmd as xs

    t = torch.as_tensor(array).to(torch_xla.device())
    padded = tuple(spec) + (None,) * (t.dim() - len(spec))
    xs.mark_sharding(t, mesh.xla_mesh, padded)
    return xla_shards(t)


def spec_dim_axes(spec: Sequence[Any], ndim: int) -> list[tuple[str, ...]]:
    """Per dimension, the mesh axes of a spec entry (``None`` -> ``()``, ``"a"`` -> ``("a",)``),
    padded with ``()`` to ``ndim``."""
    out = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return out + [()] * (ndim - len(out))


def reference_ranges(mesh: ts.Mesh, spec: Sequence[Any], shape: Sequence[int]) -> dict[int, Ranges]:
    """``{device: ranges}`` by the placement rule, written out one device at a time with numpy.

    The rule (torch_xla's; JAX's for even shapes): a dimension of size ``n`` split over mesh
    axes ``(a, b, ...)`` has ``k = |a| * |b| * ...`` shards; the device at mesh coordinates
    ``(.., i_a, .., i_b, ..)`` holds shard ``j = (i_a * |b| + i_b) * ...`` (the first axis
    named is the major one), the rows ``[min(j * c, n), min((j + 1) * c, n))`` with
    ``c = ceil(n / k)``. Reads only ``mesh.devices`` and ``mesh.axis_names``.
    """
    devices = np.asarray(mesh.devices)
    names = list(mesh.axis_names)
    dims = spec_dim_axes(spec, len(shape))
    out = {}
    for coords in np.ndindex(*devices.shape):
        ranges = []
        for n, axes in zip(shape, dims, strict=True):
            j, k = 0, 1
            for axis in axes:
                size = devices.shape[names.index(axis)]
                j = j * size + coords[names.index(axis)]
                k *= size
            c = math.ceil(n / k)
            ranges.append((min(j * c, n), min((j + 1) * c, n)))
        out[int(devices[coords])] = tuple(ranges)
    return dict(sorted(out.items()))


def virtual_host_of(num_hosts: int, num_devices: int = 8) -> tuple[int, ...]:
    """``virtual_hosts``' device -> host map, written out: host ``h`` owns the ids
    ``h * num_devices // num_hosts`` up to ``(h + 1) * num_devices // num_hosts - 1``."""
    per_host = num_devices // num_hosts
    return tuple(d // per_host for d in range(num_devices))


def host_segments(
    index_map: Mapping[int, Ranges], device_host: Sequence[int], ndim: int
) -> dict[int, list[list[tuple[int, int]]]]:
    """For each host, per dimension, the sorted distinct ranges its devices hold."""
    out: dict[int, list[set[tuple[int, int]]]] = {}
    for d, ranges in index_map.items():
        sets = out.setdefault(device_host[d], [set() for _ in range(ndim)])
        for i in range(ndim):
            sets[i].add(ranges[i])
    return {h: [sorted(s) for s in sets] for h, sets in sorted(out.items())}


def layout_is_uniform(segments: Mapping[int, list[list[tuple[int, int]]]], ndim: int) -> bool:
    """Process-uniform along every dim: equal counts per host, and the distinct per-host sets
    are disjoint (they then partition all ranges)."""
    for i in range(ndim):
        distinct = {tuple(seg[i]) for seg in segments.values()}
        if len({len(s) for s in distinct}) != 1:
            return False
        flat = [r for s in distinct for r in s]
        if len(flat) != len(set(flat)):
            return False
    return True


def take_segments(array: np.ndarray, segments: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
    """``array``'s block made of ``segments`` (per dimension, ranges concatenated in order)."""
    out = array
    for dim, ranges in enumerate(segments):
        idx = np.concatenate([np.arange(a, b) for a, b in ranges]) if ranges else np.arange(0)
        out = np.take(out, idx, axis=dim)
    return out


def num_partitions(shape: Sequence[int], mesh: ts.Mesh, spec: Sequence[Any]) -> list[int]:
    """Shards per dimension of ``shape`` under ``spec`` (axlearn's ``_infer_num_partitions``)."""
    out = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(math.prod(mesh.shape[a] for a in axes))
    return out + [1] * (len(shape) - len(out))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy (bfloat16 viewed as its raw uint16 bits, for exact compares)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.numpy()


# The note a deferred agreement check adds to its error (torchshard/_backend/dtensor/
# deferred.py): where it was raised and which call it belongs to.
DEFERRAL_NOTE = re.compile(
    r" \(Raised (at the first use of its result|at the next torchshard call on its stream "
    r"\(.*?\)|on leaving the mesh|at interpreter exit|when a new default process group "
    r"replaced its own): the agreement check of (\S+) call "
    r"#(\d+) on stream '([^']*)', judged off the step's path; "
    r"torchshard\.set_agreement_deferred\(False\) judges it in the call\.\)$"
)


def without_deferral_note(text: str) -> str:
    """``text`` without a deferred agreement check's note (the error's own wording)."""
    return DEFERRAL_NOTE.sub("", text)


def use_every_tensor(tree: Any) -> Any:
    """Reads every tensor of ``tree`` once (an op on each: a deferred agreement check is
    judged at the first); returns ``tree``."""
    leaves = torch.utils._pytree.tree_leaves(tree)
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            _ = x + 0 if x.dtype != torch.bool else x.clone()
    return tree
