"""torchshard in Lightning: ``passthrough(strategy)``.

A ``GlobalBatchLoader`` needs nothing else under Lightning's CPU/GPU DDP strategies: they pass
an iterable that is no ``DataLoader`` through (no ``DistributedSampler`` is injected), and
Lightning's per-epoch ``set_epoch`` reaches the loader's source sampler through
``loader.sampler`` (so each epoch has its order). Nor under torch_xla's SPMD path, Lightning's
``SingleDeviceXLAStrategy`` (``devices=1``: one process per host, the process's one virtual
device), whose ``process_dataloader`` is the identity. Lightning's multi-process
``XLAStrategy`` (one process per device, not SPMD), though, wraps every loader in torch_xla's
``MpDeviceLoader``, which would move batches that are already global XLA tensors and hides
``loader.sampler`` from Lightning's ``set_epoch``; ``passthrough(strategy)`` makes any strategy
hand a ``GlobalBatchLoader`` to the loop as it is (other loaders still go through the
strategy's own ``process_dataloader``).

Lightning (``lightning`` or ``pytorch_lightning``) is imported on first use.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torchshard._core.optional import require
from torchshard.data._loader.loader import GlobalBatchLoader

S = TypeVar("S")


def _strategy_types() -> tuple[type, ...]:
    found: list[type] = []
    for module in ("lightning.pytorch.strategies", "pytorch_lightning.strategies"):
        try:
            strategies = require(module, "passthrough", extra="stacks", package="lightning")
            found.append(strategies.Strategy)
        except ImportError:
            continue
    if not found:
        require(
            "lightning.pytorch.strategies",
            "torchshard.integrations.lightning",
            extra="stacks",
            package="lightning",
        )
    return tuple(found)


def passthrough(strategy: S, /) -> S:
    """``strategy`` (a Lightning ``Strategy`` instance, e.g. ``SingleDeviceXLAStrategy(0)``,
    ``XLAStrategy()`` or ``DDPStrategy()``), changed so that its ``process_dataloader`` returns
    a ``GlobalBatchLoader`` unchanged; returned for ``Trainer(strategy=passthrough(...))``.

    Raises:
        MissingDependencyError: Lightning is not installed.
        TypeError: ``strategy`` is not a Lightning ``Strategy`` instance (a name such as
            ``"xla"`` cannot be changed: pass the strategy object).

    Example::

        from lightning.pytorch.strategies import SingleDeviceXLAStrategy
        trainer = L.Trainer(accelerator="tpu", devices=1, max_epochs=2,  # SPMD: one process
                            strategy=passthrough(SingleDeviceXLAStrategy(0)))
        trainer.fit(model, train_dataloaders=GlobalBatchLoader(source, partition=P("data")))
    """
    types = _strategy_types()
    if not isinstance(strategy, types):
        raise TypeError(
            "passthrough: expected a Lightning Strategy instance (e.g. XLAStrategy() or "
            f"DDPStrategy()), but got {strategy!r:.80} of type {type(strategy).__name__}; a "
            "strategy given by name cannot be changed, pass the strategy object."
        )
    original = strategy.process_dataloader  # type: ignore[attr-defined]
    if getattr(original, "_torchshard_passthrough", False):
        return strategy

    def process_dataloader(dataloader: Any) -> Any:
        if isinstance(dataloader, GlobalBatchLoader):
            return dataloader
        return original(dataloader)

    process_dataloader._torchshard_passthrough = True  # type: ignore[attr-defined]
    strategy.process_dataloader = process_dataloader  # type: ignore[attr-defined]
    return strategy
