"""The loader's wing: ``GlobalBatchLoader`` and what exists only for it, in the order data flows.

One epoch (``iter(loader)``):

``loader.py`` (``GlobalBatchLoader``: arguments, ``iter()``, ``close``, the DataLoader protocol
of ``source.py``, ``state_dict``) -> ``plan.py`` (``EpochPlan``: every decision of the epoch,
made once in ``iter()`` and frozen) -> ``producer.py`` (``Producer``: pull, check, dispatch,
place each batch; the plan picks its mode) with ``batch_check.py`` (every batch against the
first; the partition against the dispatchers' feeds), ``echo.py`` (DataLoader workers that all
read one stream), ``last_batch.py`` (``last_batch=``: padding, statuses, the settled end) and
``exchanges.py`` (``Exchanges``: the epoch's outcome exchanges between the processes) ->
``prefetch.py`` (where batches are made: ``Prefetcher`` on a thread, ``InPlace`` in ``next()``;
the run's life as one state) on ``threads.py`` (daemon threads parked between epochs) ->
``epoch.py`` (``Epoch``: the consumer's ``next()``) -> ``cursor.py`` (``Cursor``: the
consumer's position) and ``stats.py`` (``LoaderStats``, ``Counters``); ``local.py``
(``local=True``'s epoch) yields the batches' local views.

Around the epochs: ``checkpoint.py`` (the sources' snapshots and the state's layout, for
``state_dict``/``load_state_dict``) and ``exit.py`` (process exit: every loader thread stopped
and joined, boundedly, before the interpreter finalizes).

Words: the data *ends* by itself (``EndOfData``, ``END_OF_DATA``, a run's ``Life.ENDED``);
an owner *closes* what it stops from outside (``close()``, ``Closer``, ``close_channel``, a
run's ``Life.RETIRED``); a thread's job *finishes* (``Life.FINISHED``). A *stream* is only an
iterable source without a sampler (an ``IterableDataset``); the processes' exchanges run on a
*channel*.
"""
