"""Lightning (torchshard.integrations.lightning): ``passthrough`` makes a strategy hand a
GlobalBatchLoader to the loop untouched (the XLA strategy would wrap it in MpDeviceLoader);
and a 2-process Lightning DDP run on CPU (torchrun, gloo) over two epochs, fed by a
GlobalBatchLoader, has a new order each epoch and the losses of Lightning's own feed (its
DistributedSampler), bit for bit: ``examples/stacks/lightning_ddp.py``. Skips without
Lightning."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning", reason="needs lightning: pip install 'torchshard[stacks]'")
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

import torchshard as ts
from torchshard.integrations.lightning import passthrough

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Wrapping(SingleDeviceStrategy):
    """A strategy that wraps every loader, as Lightning's XLAStrategy does (MpDeviceLoader)."""

    def process_dataloader(self, dataloader):
        return ("wrapped", dataloader)


def test_passthrough_hands_the_loader_over_as_it_is():
    strategy = passthrough(Wrapping(device=torch.device("cpu")))
    loader = ts.GlobalBatchLoader([{"x": torch.ones(2)}])
    assert strategy.process_dataloader(loader) is loader
    other = [1, 2]
    assert strategy.process_dataloader(other) == ("wrapped", other)  # others as before
    assert passthrough(strategy) is strategy  # idempotent
    assert passthrough(strategy).process_dataloader(other) == ("wrapped", other)
    ddp = passthrough(DDPStrategy())
    assert ddp.process_dataloader(loader) is loader


def test_passthrough_needs_a_strategy_object():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "passthrough: expected a Lightning Strategy instance (e.g. XLAStrategy() or "
            "DDPStrategy()), but got 'xla' of type str; a strategy given by name cannot be "
            "changed, pass the strategy object."
        ),
    ):
        passthrough("xla")


def test_two_process_ddp_run_reshuffles_and_matches_lightnings_feed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHSHARD_EXAMPLE_DIR": str(tmp_path)}
    for var in ("PJRT_DEVICE", "XLA_FLAGS", "CPU_NUM_DEVICES", "XLA_USE_SPMD"):
        env.pop(var, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",  # port 0 hangs Lightning's rendezvous
        str(ROOT / "examples" / "stacks" / "lightning_ddp.py"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("lightning_ddp rank")]
    assert sorted(lines) == [
        "lightning_ddp rank 0: 2 epochs, new order each epoch, losses equal to Lightning's feed",
        "lightning_ddp rank 1: 2 epochs, new order each epoch, losses equal to Lightning's feed",
    ], out.stdout[-2000:] + out.stderr[-2000:]
