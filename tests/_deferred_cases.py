"""Cases of a direct ``host_to_global_array`` whose agreement check is deferred (run by
``_multiproc``'s workers as ``"_deferred_cases:<name>"``; pure torch, no torch_xla): rank 1
passes a different shape, and each case records where the check's error came out."""

from __future__ import annotations

from typing import Any

import torch


def _ts() -> Any:
    import torchshard

    return torchshard


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def disagree_then(at: str) -> dict[str, Any]:
    """Rank 1 passes 2 rows where rank 0 passes 4; then ``at``: ``"use"`` (an op on the
    result), ``"next"`` (another call, no use), ``"exit"`` (leaving the mesh, no use),
    ``"interpreter"`` (the interpreter-exit hook, no use). Then a call in step and a read-back
    on every rank (the processes are still in step)."""
    import torch.distributed as dist

    ts = _ts()
    rank = dist.get_rank()
    mesh = ts.create_device_mesh((dist.get_world_size(),), ("data",), backend="dtensor")
    rows = 4 if rank == 0 else 2
    out: dict[str, Any] = {"returned": False, "error": "no error", "local_type": None}
    default = ts.set_agreement_deferred(True)  # deferred at any size (by default from 64)
    with mesh:
        try:
            try:
                g = ts.host_to_global_array({"x": torch.ones(rows, 3)})
                out["returned"] = True
                out["local_type"] = type(g["x"].to_local()).__name__
                if at == "use":
                    g["x"] + 1
                elif at == "next":
                    ts.host_to_global_array({"y": torch.zeros(4)})
                elif at == "interpreter":
                    from torchshard._backend.dtensor import deferred

                    deferred._at_exit()
            finally:
                if at == "exit":
                    mesh.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001 -- the message is the result
            out["error"] = _error(e)
        finally:
            if at == "exit":
                mesh.__enter__()
        if out["returned"]:
            out["local_type_after"] = type(g["x"].to_local()).__name__
        after = ts.host_to_global_array({"x": torch.full((4, 3), float(rank))})
        out["after"] = ts.replicate_to_local_data(after["x"])
    ts.set_agreement_deferred(default)
    return out


def switched(how: str) -> dict[str, Any]:
    """``set_agreement_deferred(False)`` (``"sync"``) or ``set_agreement_check(False)``
    (``"off"``): where a disagreement comes out (the check off: nowhere, equal inputs only)."""
    import torch.distributed as dist

    ts = _ts()
    rank = dist.get_rank()
    mesh = ts.create_device_mesh((dist.get_world_size(),), ("data",), backend="dtensor")
    out: dict[str, Any] = {"returned": False, "error": "no error"}
    with mesh:
        if how == "sync":
            old = ts.set_agreement_deferred(False)
            rows = 4 if rank == 0 else 2
        else:
            old = ts.set_agreement_check(False)
            rows = 4
        try:
            g = ts.host_to_global_array({"x": torch.ones(rows, 3)})
            out["returned"] = True
            out["local_type"] = type(g["x"].to_local()).__name__
            out["sum"] = float((g["x"] * 2).to_local().sum())
        except Exception as e:  # noqa: BLE001 -- the message is the result
            out["error"] = _error(e)
        finally:
            if how == "sync":
                ts.set_agreement_deferred(old)
            else:
                ts.set_agreement_check(old)
    return out


def skipped_then_used() -> dict[str, Any]:
    """Rank 1 skips a call that rank 0 makes; rank 0 uses the result (the check waits there,
    bounded by the group's timeout)."""
    import time

    import torch.distributed as dist

    ts = _ts()
    mesh = ts.create_device_mesh((dist.get_world_size(),), ("data",), backend="dtensor")
    ts.set_agreement_deferred(True)  # at any size (by default from 64 processes)
    with mesh:
        ts.host_to_global_array({"x": torch.ones(2, 3)})
        if dist.get_rank() == 1:
            return {"error": "skipped", "seconds": 0.0}
        t0 = time.monotonic()
        try:  # torch 2.9 raises in the call; a deferred check at the first use
            g = ts.host_to_global_array({"x": torch.ones(2, 3)})
            g["x"] * 2
            error = "no error"
        except Exception as e:  # noqa: BLE001 -- the message is the result
            error = _error(e)
    return {"error": error, "seconds": time.monotonic() - t0}
