"""``describe_layout``: which host and which device own which block of a global array.

Pure maths from ``NamedSharding.devices_indices_map`` and a device -> host map (the runtime
topology, or ``num_hosts`` contiguous, equal groups of device ids as ``virtual_hosts`` splits
them), for planning a pod layout without a pod. ``layout_of_tensor`` builds the same object from
the blocks the runtime reports for a placed tensor. Drawing is in ``_visualize.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torchshard._index import NamedSharding, check_device_process
from torchshard._layout import block_offsets
from torchshard._mesh import Mesh
from torchshard._spec import PartitionSpec, as_partition_spec

if TYPE_CHECKING:
    from torchshard._backend import Backend, LocalShard

Ranges = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class LayoutBlock:
    """One device's block: its id, its host, and its global ``[start, stop)`` per dimension."""

    device: int
    host: int
    ranges: Ranges

    @property
    def index(self) -> tuple[slice, ...]:
        """The block as slices of the global array."""
        return tuple(slice(a, b) for a, b in self.ranges)


@dataclasses.dataclass(frozen=True)
class ShardingLayout:
    """Who owns which block of a global array: one ``LayoutBlock`` per device, ascending ids.

    ``str(layout)`` is a plain-text grid (1-D and 2-D arrays) or table (other ranks);
    ``torchshard.visualize_sharding(layout)`` prints it (with ``rich`` when installed) and
    ``layout.save_png(path)`` draws it with matplotlib.

    Attributes:
        global_shape: the shape of the global array.
        blocks: every (known) device's block; a tensor read on one host of many lists only that
            host's devices.
        num_hosts: the number of hosts of the device -> host map.
        mesh: the mesh, when known.
        spec: the partition spec, when the layout was described from one.
    """

    global_shape: tuple[int, ...]
    blocks: tuple[LayoutBlock, ...]
    num_hosts: int
    mesh: Mesh | None = None
    spec: PartitionSpec | None = None

    def devices_indices_map(self) -> dict[int, tuple[slice, ...]]:
        """``{device id: slices}``, as ``NamedSharding.devices_indices_map``."""
        return {b.device: b.index for b in self.blocks}

    def host_of(self, device: int) -> int:
        """The host that owns ``device``."""
        for b in self.blocks:
            if b.device == device:
                return b.host
        raise KeyError(f"device {device} is not in this layout (devices {self.devices}).")

    @property
    def devices(self) -> tuple[int, ...]:
        """The device ids of the layout, ascending."""
        return tuple(b.device for b in self.blocks)

    @functools.cached_property
    def distinct_blocks(self) -> dict[Ranges, tuple[LayoutBlock, ...]]:
        """Each distinct block (sorted by position) and the devices holding it (replicas)."""
        out: dict[Ranges, list[LayoutBlock]] = {}
        for b in self.blocks:
            out.setdefault(b.ranges, []).append(b)
        return {r: tuple(out[r]) for r in sorted(out)}

    def host_blocks(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per host: its devices and the shape of its local block (the distinct slices of its
        devices, concatenated per dimension, as ``NamedSharding.process_local_shape``)."""
        out = {}
        for h in sorted({b.host for b in self.blocks}):
            mine = [b for b in self.blocks if b.host == h]
            shape, _ = block_offsets([b.ranges for b in mine], len(self.global_shape))
            out[h] = (tuple(b.device for b in mine), shape)
        return out

    def title(self) -> str:
        """One line: spec, mesh, global shape, hosts."""
        what = (
            f"{self.spec!r} on {self.mesh!r}"
            if self.spec is not None
            else (f"tensor on {self.mesh!r}" if self.mesh is not None else "tensor")
        )
        hosts = f"{self.num_hosts} host" + ("s" if self.num_hosts != 1 else "")
        return f"{what}: global shape {self.global_shape}, {hosts}"

    def to_text(self) -> str:
        """The plain-text grid or table (no colours)."""
        from torchshard._visualize import render_plain

        return render_plain(self)

    def __str__(self) -> str:
        return self.to_text()

    def save_png(self, path: str, *, dpi: int = 120) -> None:
        """Draws the layout into a PNG file (needs matplotlib: ``pip install torchshard[plot]``).

        Blocks are drawn to scale in array coordinates (dim 0 down, dim 1 across), coloured
        by host and labelled with their devices; ranks other than 1 and 2 become a table.
        """
        from torchshard._visualize import save_png

        save_png(self, path, dpi=dpi)


def contiguous_hosts(num_devices: int, num_hosts: int) -> tuple[int, ...]:
    """The device -> host map of ``num_hosts`` equal, contiguous groups of device ids (device
    ``d`` on host ``d // (num_devices // num_hosts)``, as ``torchshard.testing.virtual_hosts``)."""
    if isinstance(num_hosts, bool) or not isinstance(num_hosts, int):
        raise TypeError(f"num_hosts must be an int or None, but got {num_hosts!r}.")
    if num_hosts < 1 or num_devices % num_hosts:
        raise ValueError(
            f"num_hosts must be a positive divisor of the mesh's {num_devices} devices, but got "
            f"{num_hosts}; each host owns an equal, contiguous group of device ids."
        )
    per = num_devices // num_hosts
    return tuple(d // per for d in range(num_devices))


def _shape_arg(global_shape: Any) -> tuple[int, ...]:
    try:
        shape = tuple(global_shape)
    except TypeError:
        shape = None
    if shape is None or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise TypeError(
            f"describe_layout: global_shape must be a sequence of non-negative ints, but got "
            f"{global_shape!r}."
        )
    return tuple(int(n) for n in shape)


def describe_layout(
    mesh: Mesh,
    spec: PartitionSpec | Sequence[Any] | str | None,
    global_shape: Sequence[int],
    *,
    num_hosts: int | None = None,
) -> ShardingLayout:
    """Which host and which device own which block of a ``global_shape`` array under ``spec``.

    Pure index maths (no transfer, no runtime unless ``num_hosts`` is None): the blocks are
    ``NamedSharding(mesh, spec).devices_indices_map(global_shape)``; uneven splits are
    described as torch_xla places them (the last blocks short or empty).

    Args:
        mesh: the mesh (its device ids must be ``0..size-1``).
        spec: the partition spec (``None``: replicated).
        global_shape: the global array's shape.
        num_hosts: ``None`` takes the device -> host map from the runtime topology (emulated
            inside ``virtual_hosts``); ``n`` splits the device ids into ``n`` equal,
            contiguous groups, as ``virtual_hosts(n)`` and TPU pods do.

    Returns:
        A ``ShardingLayout``; ``print(layout)`` shows the grid.

    Example:
        >>> mesh = Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> layout = describe_layout(mesh, P("data"), (16, 8), num_hosts=2)
        >>> layout.blocks[2]
        LayoutBlock(device=2, host=0, ranges=((4, 8), (0, 8)))

    ``print(layout)`` (rows: dim 0; replicated over ``model``, so device pairs share a block)::

                    0:8
              +-------------+
          0:4 | devices 0,1 |
              | host 0      |
              +-------------+
          ...
        12:16 | devices 6,7 |
              | host 1      |
              +-------------+

        host 0: devices 0-3, local block shape (8, 8)
        host 1: devices 4-7, local block shape (8, 8)
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"describe_layout: mesh must be a torchshard.Mesh, but got {mesh!r}.")
    spec = as_partition_spec(() if spec is None else spec)
    shape = _shape_arg(global_shape)
    if num_hosts is None:
        from torchshard._topology import current_topology

        topo = current_topology(mesh)
        owners, count = topo.device_process, topo.process_count
    else:
        owners, count = contiguous_hosts(mesh.size, num_hosts), num_hosts
    check_device_process(mesh, owners)
    index = NamedSharding(mesh, spec).devices_indices_map(shape)
    blocks = tuple(
        LayoutBlock(d, owners[d], tuple((s.start, s.stop) for s in index[d])) for d in sorted(index)
    )
    return ShardingLayout(shape, blocks, count, mesh, spec)


def local_shards_or_none(backend: Backend, tensor: Any) -> list[LocalShard] | None:
    """The backend's local shards of ``tensor``, or None for a tensor with no sharding."""
    try:
        return backend.local_shards([tensor])[0]
    except RuntimeError as e:
        # torch_xla 2.9: an XLA tensor never annotated (a plain ``.to(device)``) has no sharding
        # spec, and `_get_local_shards` fails with "Tensor is not sharded".
        if "not sharded" in str(e):
            return None
        raise


def layout_of_tensor(tensor: Any) -> ShardingLayout:
    """The layout of a placed global tensor, from the blocks the runtime reports for it.

    Hosts come from the current topology (emulated inside ``virtual_hosts``); the mesh is the
    current mesh, if any. On one host of many, only that host's devices are known.
    """
    from torchshard._backend import get_backend
    from torchshard._mesh import current_mesh
    from torchshard._topology import current_topology

    mesh = current_mesh()
    backend = get_backend(mesh)
    if not backend.is_global(tensor):
        import torch

        got = type(tensor).__name__
        if isinstance(tensor, torch.Tensor):
            got = f"a tensor on {tensor.device}"
        raise TypeError(
            "visualize_sharding: expected a global (XLA) tensor or a ShardingLayout, but got "
            f"{got}."
        )
    shape = tuple(int(n) for n in tensor.shape)
    topo = current_topology(mesh)
    shards = local_shards_or_none(backend, tensor)
    if shards is None:  # never annotated: whole on every local device
        whole = tuple((0, n) for n in shape)
        pairs = [(d, whole) for d in backend.local_devices(mesh)]
    else:
        pairs = [(s.device, s.ranges) for s in shards]
    blocks = tuple(
        LayoutBlock(d, topo.device_process[d], r) for d, r in sorted(pairs, key=lambda p: p[0])
    )
    return ShardingLayout(shape, blocks, topo.process_count, mesh, None)
