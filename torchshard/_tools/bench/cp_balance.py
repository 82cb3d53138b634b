"""The figure users choose a context-parallel layout by: per-rank attention work in mask blocks,
and its imbalance, for packed rows under each layout.

Rows: documents with lengths log-normal around 1.5k tokens (median 1,500, sigma 0.8, cut at the
row) packed best fit (``torchshard.data.Packer``, each document padded to a multiple of
``2 * cp`` so that every layout takes the same rows), ``ROWS`` rows per case; rows of 8k, 16k
and 32k tokens; cp 2, 4 and 8. The mask is the document-causal one (``kv <= q`` inside a
document; a run of padding is a document of its own), in blocks of 128 (FlexAttention's).

Layouts (``torchshard.context_parallel_order``, or none): ``contiguous`` (the row as it comes,
cut in ``cp`` blocks), ``head_tail`` (whole-row head-tail: torch's ``context_parallel``; shown
for its work only, torchshard refuses it for packed rows), ``per_document``, ``ptrr``. A cp rank
computes its queries against every key, both in the layout's order (as torch's
``_context_parallel_shard`` rearranges them); its work is the (query block, key block) tiles
where the mask has a 1 (FlexAttention computes exactly those). Figures per case and layout:
the imbalance, the busiest rank's work over the mean (1.00: even; the step waits for the
busiest), averaged over the rows, and the busiest rank's tiles (mean over the rows). Pure
maths: no devices.
"""

from __future__ import annotations

import numpy as np

from torchshard._tools.bench._report import Report

NAME = "cp_balance"
DESCRIPTION = "context-parallel layouts of packed rows: per-rank work in mask blocks, imbalance"
SEQ_LENS = (8192, 16384, 32768)
CPS = (2, 4, 8)
ROWS = 16
BLOCK = 128
LAYOUTS = ("contiguous", "head_tail", "per_document", "ptrr")


def tile_work(segment_ids: np.ndarray, order: np.ndarray, cp: int, block: int) -> np.ndarray:
    """Each rank's tiles of ``block`` x ``block`` where the document-causal mask has a 1, for
    queries and keys both in ``order`` (written here from the mask: not torchshard's maths)."""
    n = len(segment_ids)
    change = np.concatenate(([True], segment_ids[1:] != segment_ids[:-1]))
    doc = np.cumsum(change) - 1
    docs = int(doc[-1]) + 1
    blocks = n // block
    where = np.arange(n) // block  # the block each position of the layout falls in
    orig = np.asarray(order)
    q_last = np.full((blocks, docs), -1, dtype=np.int64)
    np.maximum.at(q_last, (where, doc[orig]), orig)
    k_first = np.full((blocks, docs), n, dtype=np.int64)
    np.minimum.at(k_first, (where, doc[orig]), orig)
    tiles = (k_first[None, :, :] <= q_last[:, None, :]).any(axis=2)  # [q block, kv block]
    return tiles.sum(axis=1).reshape(cp, -1).sum(axis=1)


def orders(segment_ids: np.ndarray, cp: int) -> dict[str, np.ndarray]:
    """Each layout's order of one row."""
    import torchshard as ts

    n = len(segment_ids)
    return {
        "contiguous": np.arange(n),
        "head_tail": np.asarray(ts.head_tail_order(n, cp)),
        "per_document": np.asarray(
            ts.context_parallel_order(segment_ids, cp, balancer="per_document")
        ),
        "ptrr": np.asarray(
            ts.context_parallel_order(segment_ids, cp, balancer="ptrr", block_size=BLOCK)
        ),
    }


def packed_rows(seq_len: int, cp: int, rows: int, seed: int = 0) -> list[np.ndarray]:
    """``rows`` rows of segment ids, packed best fit from log-normal lengths."""
    import torchshard as ts

    rng = np.random.default_rng(seed)
    n = 4 * rows * seq_len // 1500
    lengths = np.clip(rng.lognormal(np.log(1500), 0.8, n).astype(int), 1, seq_len - 2 * cp)
    docs = [np.ones(int(k), dtype=np.int32) for k in lengths]
    out: list[np.ndarray] = []
    packer = ts.data.Packer(docs, seq_len=seq_len, rows=8, pad_to_multiple_of=2 * cp)
    for batch in packer:
        out.extend(batch["segment_ids"])
        if len(out) >= rows:
            break
    return out[:rows]


def run(report: Report) -> None:
    """Imbalance and the busiest rank's tiles, per case and layout."""
    seq_lens = (2048,) if report.quick else SEQ_LENS
    cps = (2,) if report.quick else CPS
    rows = 2 if report.quick else ROWS
    for seq_len in seq_lens:
        for cp in cps:
            report.progress(f"{NAME}: rows of {seq_len}, cp {cp}")
            case = f"rows of {seq_len}, cp {cp}"
            ratios: dict[str, list[float]] = {k: [] for k in LAYOUTS}
            busiest: dict[str, list[float]] = {k: [] for k in LAYOUTS}
            for ids in packed_rows(seq_len, cp, rows):
                for layout, order in orders(ids, cp).items():
                    work = tile_work(ids, order, cp, BLOCK)
                    ratios[layout].append(float(work.max() / work.mean()))
                    busiest[layout].append(float(work.max()))
            for layout in LAYOUTS:
                report.figure(
                    NAME, case, f"{layout} imbalance", float(np.mean(ratios[layout])), "max/mean"
                )
                report.figure(
                    NAME, case, f"{layout} busiest rank", float(np.mean(busiest[layout])), "tiles"
                )
