"""The public surface: sorted __all__, every name resolves, star-imports work."""

import subprocess
import sys

import pytest

import torchshard
import torchshard.testing

MODULES = [torchshard, torchshard.testing]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_all_is_sorted_unique_and_resolves(module):
    names = module.__all__
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    assert all(isinstance(n, str) and n.isidentifier() for n in names)  # catches "a" "b" joins
    for name in names:
        assert getattr(module, name) is not None, name


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_star_import(module):
    namespace = {}
    exec(f"from {module.__name__} import *", namespace)
    assert set(module.__all__) <= set(namespace)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_public_names_are_exported_and_private_ones_are_not(module):
    public = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", "").startswith("torchshard.")
    }
    assert public <= set(module.__all__)
    assert not [n for n in module.__all__ if n.startswith("_")]


def test_issue_api_names():
    expected = {
        "Mesh", "current_mesh", "create_device_mesh", "HybridMeshShape", "PartitionSpec", "P",
        "DataPartitionType", "input_partition_spec", "data_partition_type_to_spec",
        "complete_partition_spec_tree", "NamedSharding", "host_to_global_array",
        "host_to_global_specs", "global_to_host_array", "replicate_to_local_data", "TensorSpec",
        "process_index", "process_count", "host_to_global_device_array",
    }  # fmt: skip
    assert expected <= set(torchshard.__all__)
    assert {
        "virtual_hosts",
        "host_to_global_array_per_host",
        "global_to_host_array_per_host",
    } <= set(torchshard.testing.__all__)
    assert torchshard.P is torchshard.PartitionSpec
    assert torchshard.PartitionSpec.UNCONSTRAINED is not None


def test_importing_torchshard_does_not_start_torch_xla():
    code = (
        "import sys, torchshard, torchshard.testing\n"
        "assert 'torch_xla' not in sys.modules, sorted(m for m in sys.modules if 'xla' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
