"""A plain-Python reference of packing (``torchshard.data.Packer``'s tests, and
``_core/packing.py``'s): documents into rows by first fit, best fit or concat-then-split, written
from the methods' descriptions with lists only (no numpy, nothing of torchshard)."""

from __future__ import annotations


def _padded(n, multiple):
    return -(-n // multiple) * multiple


def reference_rows(docs, seq_len, rows, method, max_documents=None, multiple=1):
    """The batches: each a list of ``rows`` rows, each row a list of pieces ``(tokens, pad)``."""
    docs = [list(d) for d in docs if len(d)]
    batches = []
    if method == "concat_split":
        out, row, used = [], [], 0
        for d in docs:
            rest = [(t, True) for t in d] + [(0, False)] * (_padded(len(d), multiple) - len(d))
            while rest:
                take = min(seq_len - used, len(rest))
                piece, rest = rest[:take], rest[take:]
                row.append(([t for t, real in piece if real], sum(not r for _, r in piece)))
                used += take
                if used == seq_len or (max_documents and len(row) == max_documents):
                    out.append(row)
                    row, used = [], 0
        if row:
            out.append(row)
        for i in range(0, len(out), rows):
            chunk = out[i : i + rows]
            batches.append(chunk + [[] for _ in range(rows - len(chunk))])
        return batches
    bins = [[] for _ in range(rows)]
    for d in docs:
        size = _padded(len(d), multiple)
        while True:
            used = [sum(len(t) + p for t, p in b) for b in bins]
            fits = [
                r
                for r in range(rows)
                if used[r] + size <= seq_len
                and (max_documents is None or len(bins[r]) < max_documents)
            ]
            if fits:
                if method == "first_fit":
                    r = fits[0]
                else:  # the fullest row with room, the first of equals
                    r = max(fits, key=lambda r: (used[r], -r))
                bins[r].append((d, size - len(d)))
                break
            batches.append(bins)
            bins = [[] for _ in range(rows)]
    if any(bins):
        batches.append(bins)
    return batches


def reference_arrays(batch, seq_len, pad_id=0):
    """One batch's rows as lists: tokens, segment ids, positions, loss mask (0/1)."""
    out = {"tokens": [], "segment_ids": [], "positions": [], "loss_mask": []}
    for row in batch:
        tokens, seg, pos, loss = [], [], [], []
        for s, (t, pad) in enumerate(row, 1):
            tokens += t + [pad_id] * pad
            seg += [s] * (len(t) + pad)
            pos += list(range(len(t) + pad))
            loss += [1] * max(len(t) - 1, 0) + [0] * (pad + (1 if t else 0))
        fill = seq_len - len(tokens)
        out["tokens"].append(tokens + [pad_id] * fill)
        out["segment_ids"].append(seg + [0] * fill)
        out["positions"].append(pos + [0] * fill)
        out["loss_mask"].append(loss + [0] * fill)
    return out
