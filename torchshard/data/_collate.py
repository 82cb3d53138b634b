"""``sharded_collate``: a ``collate_fn`` that returns global sharded batches (``num_workers=0``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import default_collate, get_worker_info

from torchshard._core.context import require_mesh, thread_mesh
from torchshard._core.errors import WorkerProcessError
from torchshard._core.partition import (
    DEFAULT_PARTITION,
    feed_partition,
)
from torchshard._mesh.mesh import Mesh
from torchshard._place.host_to_global import host_to_global_array
from torchshard._step.protocol import Dispatcher


def sharded_collate(
    collate_fn: Callable[[list[Any]], Any] = default_collate,
    *,
    partition: Any = DEFAULT_PARTITION,
    dispatcher: Dispatcher | None = None,
    mesh: Mesh | None = None,
) -> Callable[[list[Any]], Any]:
    """A ``collate_fn`` for ``DataLoader(..., num_workers=0)`` that returns global batches.

    Each call collates the examples with ``collate_fn``, applies
    ``dispatcher.logical_to_physical_batch`` if given, and calls ``host_to_global_array`` on
    the mesh (``mesh=``, or the current mesh of the thread iterating the DataLoader). There is
    no prefetching: the transfer happens inside the DataLoader's ``next()``. With worker
    processes use ``GlobalBatchLoader``, which transfers on a thread of the main process.

    Args:
        collate_fn: turns a list of examples into a host batch (default: torch's
            ``default_collate``).
        partition: as for ``host_to_global_array`` (a ``DataPartitionType`` is accepted without a
            deprecation warning). Default: ``FULL``, or the dispatcher's ``partition_spec``.
        dispatcher: an ``InputDispatcher`` (anything with ``logical_to_physical_batch``).
        mesh: the mesh; default: the current mesh at each call.

    Raises:
        WorkerProcessError: (a ``ValueError``) when called in a DataLoader worker process.

    Example (dim 0 of each batch split over the 8 devices):
        >>> from torch.utils.data import DataLoader
        >>> dataset = [{"x": np.full(2, i, np.float32)} for i in range(16)]
        >>> with torchshard.Mesh(np.arange(8), ("data",)):
        ...     loader = DataLoader(dataset, batch_size=8, collate_fn=torchshard.sharded_collate())
        ...     batch = next(iter(loader))
        >>> batch["x"].shape, batch["x"].device.type
        (torch.Size([8, 2]), 'xla')
    """
    if not callable(collate_fn):
        raise TypeError(f"collate_fn: expected a callable, but got {type(collate_fn).__name__}.")
    to_physical = getattr(dispatcher, "logical_to_physical_batch", None)
    if dispatcher is not None and not callable(to_physical):
        raise TypeError(
            "dispatcher: expected an input dispatcher (e.g. torchshard.InputDispatcher, with "
            f"logical_to_physical_batch), but got {type(dispatcher).__name__}."
        )

    def collate(examples: list[Any]) -> Any:
        info = get_worker_info()
        if info is not None:
            raise WorkerProcessError(
                f"sharded_collate: called in DataLoader worker process {info.id} of "
                f"{info.num_workers}; XLA tensors cannot be made in worker processes. Either set "
                "num_workers=0, or keep a host collate_fn in the DataLoader and wrap it: "
                "torchshard.GlobalBatchLoader(DataLoader(..., num_workers=N)) transfers on a "
                "background thread of the main process."
            )
        m = mesh if mesh is not None else require_mesh("sharded_collate")
        batch = collate_fn(examples)
        with thread_mesh(m):
            if dispatcher is not None:
                batch = dispatcher.logical_to_physical_batch(batch)
            return host_to_global_array(batch, partition=feed_partition(partition, dispatcher))

    return collate
