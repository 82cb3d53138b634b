"""This repository's own pytest configuration (pyproject.toml's ``[tool.pytest.ini_options]``):
warnings are errors, but for the one warning a dependency raises in the tests' use of it.
(``-p no:torchshard`` with this configuration: tests/testing/test_torchshard_pytestplugin.py.)"""

from __future__ import annotations

import pathlib
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_stateful_dataloader_runs_under_filterwarnings_error():
    """torchdata's StatefulDataLoader calls ``torch.set_vital``, which torch 2.15 deprecates:
    pyproject.toml ignores that one warning (by message, category and module) and no other."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    batches = [b.tolist() for b in StatefulDataLoader(list(range(6)), batch_size=3)]
    assert batches == [[0, 1, 2], [3, 4, 5]]
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["filterwarnings"] == [
        "error",
        (
            "ignore:'set_vital' is deprecated:UserWarning:"
            "torchdata.stateful_dataloader.stateful_dataloader"
        ),
        "ignore:.*TPUs have no 64-bit floats",  # torchshard's Float64Warning (test_validate.py)
    ]
