"""torchshard inside the stacks people train with; each module imports its stack on first use
and none is a dependency of torchshard (``pip install 'torchshard-input[stacks]'``, or
``pip install -e '.[stacks]'`` from a checkout, brings them):

- ``torchshard.integrations.torchtitan``: ``TorchshardDataLoader``, a torchtitan
  ``BaseDataLoader`` that wraps a torchtitan loader (or any per-rank source) in a
  ``GlobalBatchLoader`` on the data-loading mesh of ``ParallelDims``, yields local tensors and
  keys its state by dp rank;
- ``torchshard.integrations.lightning``: ``passthrough(strategy)``, so that a strategy (the
  multi-process XLA one included) passes ``GlobalBatchLoader`` through untouched; Lightning's
  own ``set_epoch`` then reaches the loader's sampler (the SPMD path,
  ``SingleDeviceXLAStrategy``, passes it through as it is);
- ``torchshard.integrations.accelerate``: ``prepare(accelerator, *objects)``, accelerate's
  ``prepare`` that refuses a ``DataLoader`` already sharded per process (accelerate would
  shard it again) and passes ``GlobalBatchLoader`` through.
"""
