"""Hypothesis strategies and bit-exact helpers shared by the property tests
(``place/test_host_to_global_properties.py``, ``backend/xla/test_backend.py``): random meshes
(rank 1-3, permuted ids), specs, shapes, dtypes and host counts."""

import math

import numpy as np
import torch
from helpers import DTYPES, take_segments, to_numpy
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st

import torchshard as ts

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
NAMES = ("a", "b", "c")


def _factorizations(n, rank):
    if rank == 1:
        return [(n,)]
    return [
        (d, *rest) for d in (1, 2, 4, 8) if n % d == 0 for rest in _factorizations(n // d, rank - 1)
    ]


@st.composite
def meshes(draw):
    rank = draw(st.integers(1, 3))
    shape = draw(st.sampled_from(_factorizations(8, rank)))
    ids = draw(st.permutations(range(8)))
    return ts.Mesh(np.asarray(ids).reshape(shape), NAMES[:rank])


@st.composite
def specs(draw, mesh, ndim):
    """A spec of length <= ndim: each mesh axis splits at most one dim (or none); entries are
    None, an axis name, or a tuple of axis names in a random order."""
    length = draw(st.integers(0, ndim))
    entries = [[] for _ in range(length)]
    for axis in draw(st.permutations(mesh.axis_names)):
        slot = draw(st.integers(-1, length - 1))
        if slot >= 0:
            entries[slot].append(axis)
    out = []
    for axes in entries:
        if not axes:
            out.append(None)
        elif len(axes) == 1 and draw(st.booleans()):
            out.append(axes[0])
        else:
            out.append(tuple(axes))
    return ts.P(*out)


def _shard_counts(mesh, spec, ndim):
    counts = []
    for entry in tuple(spec) + (None,) * (ndim - len(spec)):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        counts.append(math.prod(mesh.shape[a] for a in axes))
    return counts


def _values(dtype, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def _block(G, segments):
    """``G[segments]`` as a tensor of G's dtype (bit-exact, bfloat16 included)."""
    bits = take_segments(to_numpy(G), segments)
    t = torch.from_numpy(np.array(bits, order="C"))  # keeps 0-d arrays 0-d
    return t.view(torch.bfloat16) if G.dtype == torch.bfloat16 else t


def _bits_equal(a, b):
    a, b = to_numpy(a), to_numpy(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@st.composite
def even_cases(draw):
    mesh = draw(meshes())
    ndim = draw(st.integers(0, 3))
    spec = draw(specs(mesh, ndim))
    counts = _shard_counts(mesh, spec, ndim)
    shape = tuple(k * draw(st.integers(1, 3)) for k in counts)
    hosts = draw(st.sampled_from([1, 2, 4, 8]))
    dtype = draw(st.sampled_from(DTYPES))
    as_numpy = dtype != torch.bfloat16 and draw(st.booleans())
    return mesh, spec, shape, hosts, dtype, as_numpy, draw(st.integers(0, 2**31))


@st.composite
def uneven_cases(draw):
    mesh = draw(meshes())
    ndim = draw(st.integers(1, 3))
    spec = draw(specs(mesh, ndim))
    counts = _shard_counts(mesh, spec, ndim)
    shape = tuple(draw(st.integers(1, 2 * k + 1)) for k in counts)
    assume(any(n % k for n, k in zip(shape, counts, strict=True)))
    return mesh, spec, shape, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31))
