"""Where a placing call may run: not in a DataLoader worker process, not inside a ``torch.func``
transform (``grad``, ``vmap``).

Each of these reached the runtime before and ended badly: a worker process (fork or spawn)
hung with no outcome (it cannot reach the devices, or the other processes' collectives), and
functorch-wrapped leaves gave an obscure error. ``check_caller`` refuses at once, naming the
call and the fix; it costs about 0.4 us (a global read and a flag read).

Not checked here: ``torch.compile`` tracing a call. Dynamo runs no real Python while it traces
(``torch.compiler.is_compiling()`` there is symbolic, and a ``raise`` is a graph break that
re-runs the code eagerly, where it is ``False``), and ``torch.compiler.disable`` would import
``torch._dynamo`` (3 s) with torchshard.
"""

from __future__ import annotations

from torch.utils.data import get_worker_info

from torchshard._core.errors import WorkerProcessError
from torchshard._place._torch_private import in_functorch_transform


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
