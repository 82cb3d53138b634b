"""``Packer``: documents -> batches of packed rows, a source with its own state; and the refusal
of a ``Packer`` fed to a context-parallel layout that ignores its documents.

The packing itself (which row each document goes to, the arrays) is ``_core/packing.py``;
here: reading the documents, checking each, the batches, the state a resumed job packs the
same rows from. A feeder: it works alone (``for batch in packer``) or as a
``GlobalBatchLoader``'s source, and imports nothing of the loader's wing (``_loader/``).

**The state** (``state_dict()``, taken between batches, as the loader's snapshots are):
``documents_read`` (documents read since the epoch began, the one waiting included),
``pending`` (the document, or the rest of one, that opens the next batch: at most one, up to
one document long), ``pending_pad`` and ``batches``; and, where ``documents`` saves its own
position (``state_dict``/``load_state_dict``, or ``get_state``/``set_state``), ``documents``,
its state then. Without one, a resumed ``Packer`` reads ``documents`` again from its start
and skips ``documents_read`` of them (``iter(documents)`` must start over: a list, a dataset,
a class whose ``__iter__`` does).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from torchshard._core.checks import positive_int
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.packing import KEYS, METHODS, Pending, RowBatch, padded
from torchshard._core.partition import (
    DEFAULT_PARTITION,
    complete_partition_spec_tree,
    feed_partition,
)
from torchshard._core.sharding import NamedSharding
from torchshard._core.spec import PartitionSpec
from torchshard._core.tree import flatten, paths

_STATE_KEYS = ("batches", "documents_read", "pending", "pending_pad")


def _stateful(source: Any) -> tuple[str, str] | None:
    for get, put in (("state_dict", "load_state_dict"), ("get_state", "set_state")):
        if callable(getattr(source, get, None)) and callable(getattr(source, put, None)):
            return get, put
    return None


def _int(value: Any, name: str, *, minimum: int = 0) -> int:
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None or n < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, but got {value!r}.")
    return n


class Packer:
    """Packs variable-length documents into batches of ``rows`` fixed-length rows: an iterable
    source (for ``GlobalBatchLoader`` or a loop) with ``state_dict``/``load_state_dict``.

    Each batch is a dict of numpy arrays of shape ``[rows, seq_len]``:

    - ``tokens``: the documents' tokens (their dtype, the first document's), ``pad_id`` where
      no document is;
    - ``segment_ids`` (int32): 1, 2, ... for the documents of a row in the order they came,
      0 for padding;
    - ``positions`` (int32): each document's positions, from 0 (a piece of a split document
      starts again at 0, as grain's);
    - ``loss_mask`` (bool): ``True`` at a token whose next token (the label after the usual
      shift, ``tokens[:, i + 1]``) is the next token of the same document: no loss across a
      boundary, none on padding.

    Methods (grain's ``FirstFitPackIterDataset``, ``BestFitPackIterDataset`` without shuffled
    bins, ``ConcatThenSplitIterDataset``, whose rows these equal):

    - ``"best_fit"``: each document into the row it fits most tightly; the first document that
      fits no row closes the batch (and opens the next). Least padding of the three that keep
      documents whole.
    - ``"first_fit"``: into the first row it fits; the same close.
    - ``"concat_split"``: one after another, split where a row ends (no padding but the last
      row's; a split document's pieces are documents of their own rows).

    Deterministic: the rows depend on the documents and their order only. The last batch,
    when the documents run out, is filled up with rows of padding (segment id 0), so every
    batch has the same shape. Empty documents are skipped.

    Args:
        documents: an iterable of 1-D integer token arrays (numpy arrays, lists, CPU tensors):
            a list, a dataset, a generator, a stateful source (its position is then part of the
            packer's state).
        seq_len: the positions of a row.
        rows: the rows of a batch (the packing window: more rows, less padding).
        method: ``"best_fit"``, ``"first_fit"`` or ``"concat_split"``.
        max_documents: the most documents (pieces) in a row (``None``: no bound); for
            ``"concat_split"`` a row reaching it is closed, padded.
        pad_id: the token of padding.
        pad_to_multiple_of: pad each document to a multiple of this (its pad tokens are its
            own: its segment id, no loss): ``2 * cp`` for ``context_parallel_order``'s
            ``"per_document"`` balancer. ``seq_len`` must be a multiple of it.

    Raises (at the batch concerned): ``ValueError`` for a document that is not 1-D integers,
    or (``"best_fit"``, ``"first_fit"``) longer than a row, naming it (``documents[i]``, its
    index in the epoch) and the fix.

    Example (3 rows of 8: best fit puts the 3 beside the 5, first fit beside the 4):
        >>> docs = [np.arange(1, 5), np.arange(1, 6), np.arange(1, 4), np.arange(1, 8)]
        >>> batch = next(iter(torchshard.data.Packer(docs, seq_len=8, rows=3)))
        >>> batch["segment_ids"]
        array([[1, 1, 1, 1, 0, 0, 0, 0],
               [1, 1, 1, 1, 1, 2, 2, 2],
               [1, 1, 1, 1, 1, 1, 1, 0]], dtype=int32)
        >>> batch["loss_mask"][1].astype(int)
        array([1, 1, 1, 1, 0, 1, 1, 0])
        >>> packer = torchshard.data.Packer(docs, seq_len=8, rows=3, method="first_fit")
        >>> next(iter(packer))["segment_ids"][0]
        array([1, 1, 1, 1, 2, 2, 2, 0], dtype=int32)
    """

    def __init__(
        self,
        documents: Iterable[Any],
        *,
        seq_len: int,
        rows: int,
        method: str = "best_fit",
        max_documents: int | None = None,
        pad_id: int = 0,
        pad_to_multiple_of: int = 1,
    ) -> None:
        if not isinstance(documents, Iterable):
            raise TypeError(
                "Packer: documents must be an iterable of 1-D token arrays (a list, a dataset, a "
                f"generator), but got {type(documents).__name__}."
            )
        self.seq_len = positive_int(seq_len, "Packer: seq_len")
        self.rows = positive_int(rows, "Packer: rows")
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(
                f"Packer: method must be one of {', '.join(repr(m) for m in METHODS)}, but got "
                f"{method!r}."
            )
        self.method = method
        self.max_documents = (
            None if max_documents is None else positive_int(max_documents, "Packer: max_documents")
        )
        if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
            raise TypeError(f"Packer: pad_id must be an int, but got {pad_id!r}.")
        self.pad_id = int(pad_id)
        self.pad_to_multiple_of = positive_int(pad_to_multiple_of, "Packer: pad_to_multiple_of")
        if self.seq_len % self.pad_to_multiple_of:
            raise ValueError(
                f"Packer: seq_len {self.seq_len} is not a multiple of pad_to_multiple_of "
                f"{self.pad_to_multiple_of}: the row's end would be padding of another length. "
                f"Pass a seq_len that is a multiple of {self.pad_to_multiple_of} (e.g. "
                f"{padded(self.seq_len, self.pad_to_multiple_of)})."
            )
        self.documents = documents
        self._methods = _stateful(documents)
        self._dtype: Any = None
        self._live: dict[str, Any] = self._fresh()
        self._resume: dict[str, Any] | None = None

    # -- what a loader asks -----------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """The rows of every batch (``GlobalBatchLoader``'s ``last_batch`` reads it)."""
        return self.rows

    def set_epoch(self, epoch: int) -> None:
        """Forwards ``set_epoch`` to ``documents`` (a sampler's dataset reshuffles); raises
        ``TypeError`` when ``documents`` has none (its order cannot change per epoch)."""
        target = getattr(self.documents, "set_epoch", None)
        if not callable(target):
            raise TypeError(
                f"Packer.set_epoch({epoch}): documents ({type(self.documents).__name__}) has no "
                "set_epoch, so its order cannot change per epoch. Give the Packer documents "
                "that have one (a DataLoader over torchshard.host_sampler's order, an iterable "
                "dataset with set_epoch), or set the epoch on them yourself."
            )
        target(epoch)

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {"batches": 0, "documents_read": 0, "pending": None, "pending_pad": 0}

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch yielded (see the module's docstring); a resumed
        ``Packer`` (``load_state_dict``, then ``iter()``) yields the batches that followed."""
        state = dict(self._resume if self._resume is not None else self._live)
        if self._methods is not None and "documents" not in state:
            state["documents"] = getattr(self.documents, self._methods[0])()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a ``state_dict()``; the next ``iter()`` resumes from it. Raises ``TypeError``/
        ``ValueError`` naming ``state[...]`` before anything changes."""
        if not isinstance(state, dict):
            raise TypeError(f"Packer.load_state_dict: expected a dict, but got {state!r}.")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"Packer.load_state_dict: state is missing {missing} (a Packer's state_dict() "
                f"has {list(_STATE_KEYS)}, and 'documents' where the documents save their own)."
            )
        loaded: dict[str, Any] = {
            "batches": _int(state["batches"], "Packer.load_state_dict: state['batches']"),
            "documents_read": _int(
                state["documents_read"], "Packer.load_state_dict: state['documents_read']"
            ),
            "pending": None,
            "pending_pad": _int(
                state["pending_pad"], "Packer.load_state_dict: state['pending_pad']"
            ),
        }
        if state["pending"] is not None:
            loaded["pending"] = self._document(state["pending"], "state['pending']", empty=True)
        if self._methods is not None:
            if "documents" not in state:
                raise ValueError(
                    "Packer.load_state_dict: state has no 'documents', but the documents "
                    f"({type(self.documents).__name__}) save their own position; pass the state "
                    "a Packer over the same kind of documents saved."
                )
            getattr(self.documents, self._methods[1])(state["documents"])
            loaded["documents"] = state["documents"]
        elif iter(self.documents) is self.documents and loaded["documents_read"]:
            raise ValueError(
                f"Packer.load_state_dict: documents ({type(self.documents).__name__}) is an "
                "iterator that cannot start over and saves no position (no state_dict), so the "
                f"{loaded['documents_read']} documents read before cannot be skipped. Give the "
                "Packer documents it can read again (a list, a dataset, a class whose __iter__ "
                "starts over) or a stateful source (state_dict/load_state_dict)."
            )
        self._resume = loaded

    # -- packing ----------------------------------------------------------------------------
    def _document(self, doc: Any, where: str, *, empty: bool = False) -> np.ndarray:
        try:
            tokens = np.asarray(doc)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"Packer: {where} is not an array of tokens: {e}") from None
        if tokens.ndim == 1 and tokens.size == 0:
            return np.empty(0, dtype=self._dtype or np.int64)
        if tokens.ndim != 1 or tokens.dtype == bool or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"Packer: {where} must be a 1-D array of integer tokens, but got shape "
                f"{tuple(tokens.shape)} and dtype {tokens.dtype}."
            )
        if self._dtype is None:
            self._dtype = tokens.dtype
        elif tokens.dtype != self._dtype and not np.can_cast(tokens.dtype, self._dtype):
            info = np.iinfo(self._dtype)
            if tokens.min() < info.min or tokens.max() > info.max:
                raise ValueError(
                    f"Packer: {where} has tokens from {tokens.min()} to {tokens.max()}, which "
                    f"{self._dtype} (the first document's dtype, the batches') cannot hold. Give "
                    "every document one dtype (e.g. np.asarray(d, np.int64))."
                )
        length = padded(len(tokens), self.pad_to_multiple_of)
        if self.method != "concat_split" and length > self.seq_len and not empty:
            what = f"{len(tokens)} tokens" + (
                f" ({length} padded to a multiple of {self.pad_to_multiple_of})"
                if length != len(tokens)
                else ""
            )
            raise ValueError(
                f"Packer(method={self.method!r}): {where} has {what}, more than a row of "
                f"seq_len={self.seq_len}, and {self.method} keeps documents whole. Truncate or "
                f"split the documents to {self.seq_len} tokens before packing (e.g. "
                f"(d[:{self.seq_len}] for d in documents)), or use method='concat_split', which "
                "splits them where a row ends."
            )
        return tokens

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """One pass over the documents (resumed where ``load_state_dict`` left it)."""
        start = self._resume or self._fresh()
        self._resume = None
        it = iter(self.documents)
        if self._methods is None and start["documents_read"]:
            skipped = sum(1 for _ in itertools.islice(it, start["documents_read"]))
            if skipped < start["documents_read"]:
                raise ValueError(
                    f"Packer: resuming after {start['documents_read']} documents, but documents "
                    f"({type(self.documents).__name__}) now hold only {skipped}: they are not "
                    "the documents the state was saved over."
                )
        pending = None
        if start["pending"] is not None:
            pending = Pending(start["pending"], start["pending_pad"])
        live = {k: start[k] for k in ("batches", "documents_read")}
        live.update(pending=start["pending"], pending_pad=start["pending_pad"])
        self._live = live
        return self._batches(it, pending, live)

    def _read(self, it: Iterator[Any], live: dict[str, Any]) -> Pending | None:
        """The next non-empty document, padded; ``None`` at the end."""
        while True:
            try:
                doc = next(it)
            except StopIteration:
                return None
            index = live["documents_read"]
            live["documents_read"] = index + 1
            tokens = self._document(doc, f"documents[{index}]")
            if len(tokens):
                return Pending(tokens, padded(len(tokens), self.pad_to_multiple_of) - len(tokens))

    def _batches(
        self, it: Iterator[Any], pending: Pending | None, live: dict[str, Any]
    ) -> Iterator[dict[str, np.ndarray]]:
        concat = self.method == "concat_split"
        while True:
            batch = RowBatch(rows=self.rows, seq_len=self.seq_len, max_documents=self.max_documents)
            while True:
                doc = pending if pending is not None else self._read(it, live)
                pending = None
                if doc is None:
                    break
                if concat:
                    pending = batch.concat(doc)
                    if batch.full:
                        break
                else:
                    row = batch.fit(doc.length, self.method)
                    if row is None:
                        pending = doc
                        break
                    batch.place(row, doc)
            if batch.empty:
                return
            out = batch.assemble(self._dtype, self.pad_id)
            live["batches"] += 1
            live["pending"] = None if pending is None else pending.tokens
            live["pending_pad"] = 0 if pending is None else pending.pad
            yield out
            if pending is None and doc is None:
                return


# -- the refusal -------------------------------------------------------------------------------


def packers_of(source: Any) -> Packer | None:
    """The ``Packer`` a loader's source is, or reads (a DataLoader's ``dataset``)."""
    for s in (source, getattr(source, "dataset", None)):
        if isinstance(s, Packer):
            return s
    return None


def refuse_packed_context_parallel(
    sources: Any, partition: Any, dispatchers: Any, mesh: Mesh
) -> None:
    """Raises ``ShardingError`` when a loader's source is a ``Packer`` whose rows the partition
    splits along the sequence (dim 1) as they come: a context-parallel layout that ignores their
    documents (contiguous blocks, each rank's share of attention work unbalanced, and with
    ``context_parallel``'s causal SDPA attention across documents). Names the leaf and the
    layouts that respect documents. Must run under ``mesh``."""
    spec_tree = feed_partition(partition, None if not dispatchers else dispatchers[0])
    if spec_tree is DEFAULT_PARTITION:  # dim 0 over every axis
        return
    for source in sources:
        packer = packers_of(source)
        if packer is None:
            continue
        shape = (packer.rows, packer.seq_len)
        tree = {k: np.empty(shape, dtype=np.int32) for k in KEYS}
        if spec_tree is None or isinstance(spec_tree, PartitionSpec):
            specs = [spec_tree] * len(KEYS)
        elif isinstance(spec_tree, dict):
            specs = flatten(complete_partition_spec_tree(tree, spec_tree))[0]
        else:  # FULL and the other defaults split dim 0 only
            continue
        names = paths(flatten(tree)[1], "batch")
        for spec, path in zip(specs, names, strict=True):
            if spec is None:
                continue
            cuts = NamedSharding(mesh, spec).shard_counts(2)[1]
            if cuts > 1:
                raise ShardingError(
                    f"GlobalBatchLoader: the source is a torchshard.data.Packer, and partition "
                    f"{spec!r} splits {path} (shape [rows, seq_len] = {list(shape)}) along dim 1 "
                    f"into {cuts} context-parallel shards as the rows come, a layout that "
                    "ignores their documents: each rank's attention work is unbalanced, and "
                    "torch's context_parallel (causal SDPA) attends across documents. Feed a "
                    "layout that respects documents: wrap the packer, "
                    "torchshard.data.context_parallel_rows(packer, partition, "
                    "balancer='per_document' or 'ptrr'), which gives each process its part of "
                    "every row in that order (Packer(..., pad_to_multiple_of=2 * cp) for "
                    "'per_document')."
                )
