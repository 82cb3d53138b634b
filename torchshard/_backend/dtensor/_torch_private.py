"""Every private torch.distributed name torchshard uses, imported here once, with the versions
checked.

torch's underscore names change without notice between releases (``_StridedShard`` stopped
being a subclass of ``Shard`` in torch 2.14), so no other torchshard module imports one: they
call the functions below, and a change in a new torch release is fixed in this one file. Each
entry says which torch versions it was checked on (the DTensor tests run on each of them).
Imported only by the DTensor backend (with it, the only importer of torch.distributed). torch's
own private names (``FakeTensor``, ``torch.func``'s level), which placement needs on every
backend, are in ``_place/_torch_private.py``: those two modules hold every private torch name
torchshard uses (``tests/cross/test_layers.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

# `torch.distributed.tensor.placement_types._StridedShard(dim, split_factor)`: the placement
# FSDP2 + TP give a dim split over two mesh axes right to left. Checked on torch 2.9.0, 2.13.0,
# 2.14.1, 2.15.0: the class exists under this name with `.dim` and `.split_factor`; a subclass
# of `Shard` (equal to `Shard(dim)`) up to 2.13, a separate `Placement` from 2.14 on (its
# `is_shard()` is then False).
# `torch.distributed.tensor._utils.compute_local_shape_and_global_offset(shape, mesh,
# placements)`: this rank's local shape and global offset (used by distributed checkpointing),
# which knows DTensor's uneven and strided splits. Checked on torch 2.9.0, 2.13.0, 2.14.1,
# 2.15.0 (same signature and result).
# torch's context_parallel load balancer, the order `head_tail_order` reproduces (the tests'
# oracle; torchshard itself computes the order without it): torch 2.14.1 has
# `torch.distributed.tensor.experimental._context_parallel._load_balancer._HeadTailLoadBalancer(
# seq_length, world_size, device)._generate_indices(restore=...)` (shape (1, seq_len)); torch
# 2.9.0 has `torch.distributed.tensor.experimental._attention._generate_round_robin_indices(
# seq_length, cp_world_size, device, restore=...)` (shape (seq_len,)). Checked on both.
# torch's balancers for packed rows, the orders `context_parallel_order` reproduces for
# "per_document" and "ptrr" (the tests' and the context-parallel example's oracle; torchshard
# computes the orders without them), in the same module as `_HeadTailLoadBalancer`:
# `_PerDocumentHeadTailLoadBalancer(seq_length_per_doc, world_size, device)` and
# `_PTRRLoadBalancer(block_mask, world_size)`, each with `._generate_indices(restore=...)` of
# shape (rows, seq_len); and `torch.distributed.tensor.experimental._context_parallel.
# _context_parallel_shard(mesh, buffers, seq_dims, load_balancer)`, which keeps each cp rank's
# shard of the rearranged buffers. Checked on torch 2.14.1 (torch 2.9.0 has none of them:
# the functions below return None there).
# `torch.distributed.distributed_c10d._get_default_store()`: the default group's store (torch's
# own store-based barriers use it), through which the exchange tree's processes find each other.
# `torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)`: a group's timeout
# (`new_group` does not inherit the default group's). Checked on torch 2.9.0, 2.13.0, 2.14.1,
# 2.15.0: it exists with this signature; from torch 2.14 it is deprecated (a FutureWarning at
# every call) for the public `torch.distributed.set_timeout(timeout, group)`, which is used
# wherever torch has it (2.14.1 and 2.15.0 have it, 2.9.0 does not).
# A deferred agreement check, waited for at the first use of a tensor (`deferred.py`):
# `torch._C._distributed_c10d.PythonCallbackWork(callback)` (a `Work` whose `wait()` calls
# `callback(timeout)` and raises what it raises, its type kept), `torch._C._distributed_c10d.
# _register_work(tensor, work)` (the work the tensor's storage waits for, held until waited),
# `torch.ops._c10d_functional.wait_tensor(tensor)` (pops and waits the tensor's work) and
# `torch.distributed._functional_collectives.AsyncCollectiveTensor(tensor)` (a wrapper whose
# first op that reads data waits first; view ops wait later), set as a DTensor's
# `_local_tensor`. Checked on torch 2.13.0 and 2.14.1 (all present; an unwaited registration
# is kept until process exit, where torch warns: every one is waited by its check's
# judgement). torch 2.9.0 has no `PythonCallbackWork` (its future-made `Work` drops the
# callback's error): `first_use_wait` returns False there and the check is judged in the call.
import torch
import torch._C._distributed_c10d as _c10d_c
import torch.distributed as _dist
from torch.distributed import distributed_c10d as _c10d
from torch.distributed.tensor._utils import (
    compute_local_shape_and_global_offset as _compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

__all__ = [
    "StridedShard",
    "context_parallel_indices",
    "context_parallel_shard",
    "document_load_balancer",
    "default_store",
    "first_use_wait",
    "is_strided_shard",
    "local_shape_and_offset",
    "set_group_timeout",
    "wait_at_first_use",
    "waited",
]


def is_strided_shard(p: Placement | Any) -> bool:
    """Whether ``p`` is a ``_StridedShard`` (on every supported torch: by type, never by
    ``Shard`` subclassing or equality, which changed in torch 2.14)."""
    return isinstance(p, StridedShard)


def local_shape_and_offset(
    global_shape: tuple[int, ...], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and global offset of a DTensor of ``global_shape``."""
    return _compute_local_shape_and_global_offset(global_shape, mesh, placements)


def default_store() -> Any:
    """The default process group's store."""
    return _c10d._get_default_store()


def set_group_timeout(timeout: Any, group: Any) -> None:
    """Sets ``group``'s timeout (a ``timedelta``): torch's public ``set_timeout`` where it has
    one, else the private call it replaced."""
    public = getattr(_dist, "set_timeout", None)
    if public is not None:
        public(timeout, group)
    else:
        _c10d._set_pg_timeout(timeout, group)


def local_offset(x: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape and global offset of this rank's block of the DTensor ``x``: DTensor's
    own (``local_shape_and_offset``), which knows its sequential splitting of uneven and
    ``_StridedShard`` layouts."""
    return local_shape_and_offset(x.shape, x.device_mesh, x.placements)


def context_parallel_indices(seq_len: int, cp_size: int, *, restore: bool = False) -> list[int]:
    """torch's own head-tail order of ``context_parallel`` (``restore``: its inverse), from its
    private load balancer: the oracle of ``torchshard.head_tail_order``. Imported on first use
    (the module of torch 2.14, else the function of torch 2.9)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (  # type: ignore[import-not-found, unused-ignore]
            _HeadTailLoadBalancer,
        )
    except ImportError:  # torch 2.9
        import torch
        from torch.distributed.tensor.experimental._attention import (  # type: ignore[attr-defined, unused-ignore]
            _generate_round_robin_indices,
        )

        cpu = torch.device("cpu")
        return _generate_round_robin_indices(seq_len, cp_size, cpu, restore=restore).tolist()
    balancer = _HeadTailLoadBalancer(seq_len, cp_size, "cpu")
    return balancer._generate_indices(restore=restore)[0].tolist()


def document_load_balancer(
    balancer: str,
    cp_size: int,
    *,
    lengths: Sequence[Sequence[int]] | None = None,
    block_mask: Any = None,
) -> Any:
    """torch's load balancer for packed rows (``balancer``: ``"per_document"`` from the
    documents' ``lengths`` per row, ``"ptrr"`` from a FlexAttention ``block_mask``), the oracle
    of ``torchshard.context_parallel_order``; ``None`` where torch has none (before 2.13)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (  # type: ignore[import-not-found, unused-ignore]
            _PerDocumentHeadTailLoadBalancer,
            _PTRRLoadBalancer,
        )
    except ImportError:
        return None
    if balancer == "per_document":
        return _PerDocumentHeadTailLoadBalancer([list(x) for x in lengths or ()], cp_size, "cpu")
    if balancer == "ptrr":
        return _PTRRLoadBalancer(block_mask, cp_size)
    raise ValueError(f"document_load_balancer: unknown balancer {balancer!r}")


def context_parallel_shard(
    mesh: DeviceMesh, buffers: Sequence[Any], seq_dims: Sequence[int], load_balancer: Any
) -> list[Any] | None:
    """What each cp rank of ``mesh`` keeps of ``buffers`` rearranged by ``load_balancer``
    (torch's ``_context_parallel_shard``); ``None`` where torch has none."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import (  # type: ignore[import-not-found, unused-ignore]
            _context_parallel_shard,
        )
    except ImportError:
        return None
    return list(_context_parallel_shard(mesh, list(buffers), list(seq_dims), load_balancer))


_CALLBACK_WORK = getattr(_c10d_c, "PythonCallbackWork", None)


def first_use_wait() -> bool:
    """Whether a tensor's first use can wait for a check (and raise its error): torch >= 2.13."""
    return _CALLBACK_WORK is not None and hasattr(_c10d_c, "_register_work")


def wait_at_first_use(x: Any, judge: Any) -> torch.Tensor:
    """Makes the first op that reads DTensor ``x``'s data call ``judge()`` first (which may
    raise: the op then raises it); returns ``x``'s local tensor (for ``waited``)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    local = x._local_tensor
    assert _CALLBACK_WORK is not None
    _c10d_c._register_work(local, _CALLBACK_WORK(lambda _timeout: judge() or True))
    x._local_tensor = AsyncCollectiveTensor(local)
    return local


def waited(x: Any, local: torch.Tensor) -> None:
    """Undoes ``wait_at_first_use(x, judge)`` (which returned ``local``): drops the
    registration (calling ``judge``, which must not raise by then; nothing when ``x``'s first
    use already waited) and makes ``local`` ``x``'s local tensor again."""
    torch.ops._c10d_functional.wait_tensor(local)
    x._local_tensor = local
