"""Streams split over processes and DataLoader workers: ``stream_shard``.

A stream (an ``IterableDataset``, an HF ``datasets`` stream, a webdataset pipeline) has no
sampler: each copy of it must skip to its own shard. ``stream_shard`` says which: this process's
feed along the batch dimension of the partition (processes that hold the same rows, replicas of
a model axis, get the same feed), times the DataLoader's workers inside a worker process.

DataLoader workers are other processes: they have no current mesh, and asking the runtime for
the topology there would start it in the worker. So the process side is recorded for them in
the environment (``WORKER_RECORD``): by ``stream_shard`` and by ``GlobalBatchLoader.__iter__``,
in the main process, before the workers start. Workers started by ``fork`` or ``spawn`` inherit
the main process's environment as it is then; those started by ``forkserver`` inherit the
server's, taken when the server started (at the first DataLoader that started workers), so a
later loader's workers would read an earlier loader's record (another host's shard, another
mesh). ``GlobalBatchLoader`` therefore also hands the record to its sources' workers itself, in
their ``worker_init_fn`` (``workers_recorded``), whatever their start method.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch.utils.data

from torchshard._core.context import current_mesh, thread_mesh
from torchshard._core.errors import NoMeshError
from torchshard._core.mesh import Mesh as MeshValue
from torchshard._core.partition import DEFAULT_PARTITION, data_partition_type_to_spec
from torchshard._core.sharding import NamedSharding
from torchshard._core.spec import DataPartitionType, PartitionSpec
from torchshard._core.topology import Topology
from torchshard._mesh.context import current_topology
from torchshard._mesh.mesh import Mesh

WORKER_RECORD = "TORCHSHARD_STREAM_SHARD"


def _spec(partition: Any, mesh: MeshValue) -> PartitionSpec:
    if partition is None or partition is DEFAULT_PARTITION or partition is DataPartitionType.FULL:
        return PartitionSpec(tuple(mesh.axis_names))
    if isinstance(partition, DataPartitionType):
        spec = data_partition_type_to_spec(partition)
        return spec if isinstance(spec, PartitionSpec) else PartitionSpec(tuple(mesh.axis_names))
    if isinstance(partition, PartitionSpec):
        return partition
    raise TypeError(
        f"stream_shard: partition must be a PartitionSpec (the batch's, e.g. P('data')), a "
        f"DataPartitionType or None (dim 0 over every mesh axis), but got "
        f"{type(partition).__name__} {partition!r:.60}."
    )


def record_for_workers(
    mesh: MeshValue, topology: Topology, *, process_index: int | None = None
) -> None:
    """Leaves ``mesh`` and this process's place in ``topology`` (``process_index``: the host a
    per-host source plays) for DataLoader workers started from now on (their
    ``stream_shard`` reads it)."""
    os.environ[WORKER_RECORD] = json.dumps(
        {
            "devices": mesh.devices.tolist(),
            "axis_names": list(mesh.axis_names),
            "backend": mesh.backend,
            "process_index": topology.process_index if process_index is None else process_index,
            "device_process": list(topology.device_process),
        }
    )


class WorkerInit:
    """A DataLoader's ``worker_init_fn`` that leaves the main process's record (``record``) in
    the worker's environment, then calls the source's own ``worker_init_fn`` (``inner``), if
    any. Picklable (``spawn`` and ``forkserver`` pickle it into each worker)."""

    def __init__(self, record: str, inner: Callable[[int], Any] | None) -> None:
        self.record = record
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        os.environ[WORKER_RECORD] = self.record
        if self.inner is not None:
            self.inner(worker_id)


@contextlib.contextmanager
def workers_recorded(source: Any) -> Iterator[None]:
    """While ``iter(source)`` starts a DataLoader's worker processes, its ``worker_init_fn``
    hands them the record made last in this process (``record_for_workers``): a ``forkserver``
    worker inherits the server's environment, not this process's record. The source's own
    ``worker_init_fn`` still runs, after; it is put back afterwards."""
    record = os.environ.get(WORKER_RECORD)
    workers = getattr(source, "num_workers", 0)
    if (
        not record
        or isinstance(workers, bool)
        or not isinstance(workers, int)
        or workers < 1
        or not hasattr(source, "worker_init_fn")
    ):
        yield
        return
    original = source.worker_init_fn
    inner = original.inner if isinstance(original, WorkerInit) else original
    try:
        source.worker_init_fn = WorkerInit(record, inner)
    except (AttributeError, TypeError, ValueError):  # a source that does not let it be set
        yield
        return
    try:
        yield
    finally:
        source.worker_init_fn = original


def _recorded() -> tuple[MeshValue, int, tuple[int, ...]] | None:
    text = os.environ.get(WORKER_RECORD)
    if not text:
        return None
    r = json.loads(text)
    mesh = MeshValue(
        np.asarray(r["devices"], dtype=np.int64), tuple(r["axis_names"]), backend=r["backend"]
    )
    return mesh, int(r["process_index"]), tuple(int(p) for p in r["device_process"])


def stream_shard(partition: Any = None, *, mesh: Mesh | None = None) -> tuple[int, int]:
    """``(index, count)``: which shard of a stream this copy of it reads, over the processes'
    feeds and, inside a DataLoader worker, the workers (HF ``split_dataset_by_node``'s role).

    The process side is this process's feed along dim 0 of ``partition`` on ``mesh`` (default:
    the current mesh; ``partition=None``: dim 0 over every mesh axis, the loader's default):
    processes whose devices hold the same rows (replicas along an axis the partition does not
    split) read the same shard. Inside a DataLoader worker ``w`` of ``W`` the answer is
    ``(index * W + w, count * W)``, from the mesh and topology the main process recorded for its
    workers (``stream_shard`` and ``GlobalBatchLoader`` record them before workers start).

    Split a stream with it in the main process (HF datasets: ``split_dataset_by_node(ds,
    rank=index, world_size=count)``; ``datasets`` then splits by worker itself), or inside the
    dataset's ``__iter__`` (a webdataset-style stream reads ``shards[index::count]``).

    Raises:
        NoMeshError: outside a worker, without ``mesh=`` or a current mesh; inside a worker,
            when the main process recorded nothing (call ``stream_shard`` there first).

    Example (one process):
        >>> with torchshard.Mesh(np.arange(8), ("data",)):
        ...     torchshard.stream_shard()
        (0, 1)
    """
    worker = torch.utils.data.get_worker_info()
    m: MeshValue | None = mesh if mesh is not None else current_mesh()
    if worker is not None:
        recorded = _recorded()
        if recorded is None:
            raise NoMeshError(
                "stream_shard: inside a DataLoader worker, but the main process recorded no mesh "
                "for its workers: call torchshard.stream_shard() (inside `with mesh:`) in the main "
                "process before the DataLoader starts its workers, or iterate it through "
                "GlobalBatchLoader."
            )
        rec_mesh, process_index, device_process = recorded
        spec = _spec(partition, rec_mesh if m is None else m)
        index, count = NamedSharding(
            m if m is not None else rec_mesh, spec
        ).process_index_and_count(
            0, ndim=max(len(spec), 1), process_index=process_index, device_process=device_process
        )
        return index * worker.num_workers + worker.id, count * worker.num_workers
    if m is None:
        raise NoMeshError(
            "stream_shard: needs a mesh: call it inside `with mesh:` or pass "
            "stream_shard(mesh=mesh)."
        )
    spec = _spec(partition, m)  # checked before the runtime is asked for its topology
    with thread_mesh(m):
        topology = current_topology(m)
    index, count = NamedSharding(m, spec).process_index_and_count(
        0,
        ndim=max(len(spec), 1),
        process_index=topology.process_index,
        device_process=topology.device_process,
    )
    record_for_workers(m, topology)
    return index, count
