"""Where a placing call may run: not in a DataLoader worker process, not inside a ``torch.func``
transform (``grad``, ``vmap``).

Each of these reached the runtime before and ended badly: a worker process (fork or spawn)
hung with no outcome (it cannot reach the devices, or the other processes' collectives), and
functorch-wrapped leaves gave an obscure error. ``check_caller`` refuses at once, naming the
call and the fix; it costs about 0.4 us (a global read and a flag read). A tensor kept from
inside a transform and passed after it is a leaf question (``host_data.unwrapped``).

Under ``torch.compile``: Dynamo cannot trace placing or reading back (optree's C flatten,
torch_xla's data calls; tracing ``host_to_global_array`` failed with "AssertionError: unsafe
constant" from ``place.py``), and these calls handle host data, which a graph does not hold.
So the public calls run eagerly there (``eagerly``): when ``torch.compiler.is_compiling()``,
they call themselves through ``torch.compiler.disable``, a graph break at the call. A raise
could not say so: a raise under tracing is a graph break too, which re-runs the code eagerly,
where ``is_compiling()`` is ``False``. ``torch._dynamo`` is imported only then (3 s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.data import get_worker_info

from torchshard._core.errors import WorkerProcessError
from torchshard._place._torch_private import in_functorch_transform

F = TypeVar("F", bound=Callable[..., object])


def eagerly(fn: F) -> F:
    """``fn`` run outside torch.compile's tracing (call it when
    ``torch.compiler.is_compiling()``): Dynamo breaks the graph at the call and runs it
    eagerly, with Dynamo off inside."""
    return torch.compiler.disable(fn)


def check_caller(caller: str) -> None:
    """Raises unless ``caller`` (``"host_to_global_array"``) may run here:
    ``WorkerProcessError`` in a DataLoader worker process, ``RuntimeError`` inside a
    ``torch.func`` transform."""
    info = get_worker_info()
    if info is not None:
        raise WorkerProcessError(
            f"{caller}: called in DataLoader worker process {info.id} of {info.num_workers} "
            "(from a dataset or a collate_fn); global tensors cannot be made in worker "
            "processes, which reach neither the devices nor the other processes. Keep a host "
            "collate_fn in the DataLoader and wrap it: torchshard.GlobalBatchLoader(DataLoader"
            "(..., num_workers=N)) transfers on a thread of the main process "
            "(torchshard.sharded_collate() is for num_workers=0)."
        )
    if in_functorch_transform():
        raise RuntimeError(
            f"{caller}: called inside a torch.func transform (grad, vmap, jacrev, ...), whose "
            "wrapped tensors are not host data. Place the data before the transform and pass "
            "the global tensors in."
        )
