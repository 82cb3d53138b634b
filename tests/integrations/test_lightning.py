"""Lightning (torchshard.integrations.lightning): ``passthrough`` makes a strategy hand a
GlobalBatchLoader to the loop untouched (the XLA strategy would wrap it in MpDeviceLoader);
and a 2-process Lightning DDP run on CPU (torchrun, gloo) over two epochs, fed by a
GlobalBatchLoader, has a new order each epoch and the losses of Lightning's own feed (its
DistributedSampler), bit for bit: ``examples/stacks/lightning_ddp.py``; its mid-epoch resume
from rank 0's checkpoint on both ranks: ``examples/stacks/lightning_resume.py``. And Lightning's own
XLA path under SPMD (one process, ``SingleDeviceXLAStrategy`` on the 8 emulated devices): a
``Trainer.fit`` of two epochs gets the loader's global batches as the loader made them, with a
new order in epoch 2. Skips without Lightning (and the XLA test without torch_xla)."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from torchshard._core.version import pip_install

pytest.importorskip("lightning", reason=f"needs lightning: {pip_install('stacks')}")
import lightning as L
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


def test_two_process_mid_epoch_resume_from_rank_0s_checkpoint(tmp_path):
    """Lightning writes rank 0's loader state alone; ``trainer.fit(ckpt_path=...)`` after a
    stop mid-epoch resumes both ranks from it (rank 1 from the common entry: the epoch and the
    examples consumed), each seeing exactly what Lightning's own uninterrupted ``Trainer`` run
    gave it: ``examples/stacks/lightning_resume.py``. On the old code rank 1 raised
    "ValueError: state_dict: expected this process's entry 'process_1', but the state holds
    ['process_0']", and the resumed epoch's len() differed between the ranks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHSHARD_EXAMPLE_DIR": str(tmp_path)}
    for var in ("PJRT_DEVICE", "XLA_FLAGS", "CPU_NUM_DEVICES", "XLA_USE_SPMD"):
        env.pop(var, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(ROOT / "examples" / "stacks" / "lightning_resume.py"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("lightning_resume rank")]
    tail = (
        ": stopped after step 3, resumed from rank 0's checkpoint at step 4, every example of "
        "the uninterrupted run once, losses equal"
    )
    assert sorted(lines) == [f"lightning_resume rank {r}{tail}" for r in range(2)], (
        out.stdout[-2000:] + out.stderr[-2000:]
    )


def emulated_xla_accelerator():
    """Lightning's ``XLAAccelerator`` for the CPU-emulated devices. It counts TPU chips
    (``torch_xla._internal.tpu.num_available_devices``, which asks the GCE metadata server for
    the TPU version), so without a TPU it is not available and cannot parse ``devices=1``; the
    three methods here say one device, everything else is Lightning's."""
    from lightning.pytorch.accelerators import XLAAccelerator

    class EmulatedXLAAccelerator(XLAAccelerator):
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def parse_devices(devices):
            assert devices == 1, devices  # SPMD: one process, the one (virtual) device
            return 1

        @staticmethod
        def get_parallel_devices(devices):
            return [torch.device("xla", 0)]

    return EmulatedXLAAccelerator()


@pytest.mark.xla
# Lightning 2.6's XLA strategy and precision call xm.xla_device and xm.mark_step, deprecated
# in torch_xla 2.9 ("Use torch_xla.device instead", "Use torch_xla.sync instead").
@pytest.mark.filterwarnings("ignore:Use torch_xla.(device|sync) instead:DeprecationWarning")
def test_lightnings_single_xla_strategy_takes_the_global_batches_under_spmd(tmp_path, mesh8):
    """What a torch_xla SPMD user of Lightning runs: one process per host, ``xr.use_spmd()``
    (the plugin's emulation), ``devices=1`` and ``SingleDeviceXLAStrategy`` (Lightning's
    ``XLAStrategy`` is one process per device: ``xmp.spawn``, which SPMD's started runtime
    refuses). Its ``process_dataloader`` is the identity, so the batches that reach
    ``training_step`` are the loader's global XLA tensors, sharded over the 8 devices as the
    loader made them (no ``MpDeviceLoader``), and Lightning's ``set_epoch`` reshuffles."""
    from lightning.pytorch.strategies import SingleDeviceXLAStrategy

    data = [
        {"x": torch.full((4,), float(i)), "y": torch.full((1,), float(i % 3))} for i in range(32)
    ]
    sampler = ts.host_sampler(data, ts.P("data"), seed=3)  # 1 process: the whole order
    loader = ts.GlobalBatchLoader(
        DataLoader(data, batch_size=8, sampler=sampler), partition=ts.P("data"), mesh=mesh8
    )

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.seen = []  # (epoch, type, device, sharding, the rows' first column)

        def training_step(self, batch, i):
            import torch_xla

            x = batch["x"]
            spec = torch_xla._XLAC._get_xla_sharding_spec(x)
            self.seen.append((self.current_epoch, type(x), x.device, spec, x.cpu()[:, 0]))
            return torch.nn.functional.mse_loss(self.net(x), batch["y"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = SingleDeviceXLAStrategy(device=0)
    assert strategy.process_dataloader(loader) is loader  # no MpDeviceLoader, passthrough or not
    trainer = L.Trainer(
        accelerator=emulated_xla_accelerator(),
        devices=1,
        strategy=passthrough(strategy),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    model = Model()
    trainer.fit(model, train_dataloaders=loader)
    assert trainer.train_dataloader is loader
    expected = []
    for epoch in range(2):  # the rows host_sampler gives each epoch, 8 a batch
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.float32)
        expected += [(epoch, order[k : k + 8]) for k in range(0, 32, 8)]
    assert [(e, rows.tolist()) for e, *_, rows in model.seen] == [
        (e, rows.tolist()) for e, rows in expected
    ]
    assert not torch.equal(expected[0][1], expected[4][1])  # epoch 2: a new order
    for _, kind, device, spec, _ in model.seen:
        assert (kind, device, spec) == (
            torch.Tensor,
            torch.device("xla", 0),
            "{devices=[8,1]0,1,2,3,4,5,6,7}",
        )
