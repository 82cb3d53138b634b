"""The stacks' imports (torchshard.integrations._optional): a missing stack raises
MissingDependencyError naming the package and the extra."""

import re

import pytest

import torchshard as ts
from torchshard.integrations._optional import require


def test_a_missing_stack_names_what_to_install():
    with pytest.raises(
        ts.errors.MissingDependencyError,
        match=re.escape(
            "torchshard.integrations.nothing needs no-such-stack, which is not installed or "
            "cannot be imported (No module named 'no_such_stack_x'); install it (`pip install "
            "no-such-stack`, or `pip install 'torchshard[stacks]'` for every stack torchshard "
            "integrates with)."
        ),
    ):
        require("no_such_stack_x", "no-such-stack", "torchshard.integrations.nothing")


def test_a_present_module_is_returned():
    import json

    assert require("json", "json", "x") is json


def test_importing_torchshard_imports_no_stack():
    import subprocess
    import sys

    code = (
        "import sys, torchshard, torchshard.integrations;"
        "print(sorted(m for m in ('lightning', 'accelerate', 'torchtitan', "
        "'torchshard.integrations.lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
