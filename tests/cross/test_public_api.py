"""The public surface: sorted __all__, every name resolves, star-imports work."""

import pathlib
import subprocess
import sys

import pytest

import torchshard
import torchshard.data
import torchshard.errors
import torchshard.testing

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = [torchshard, torchshard.data, torchshard.testing, torchshard.errors]

# The public surface, listed: a name added or removed changes this test on purpose.
SURFACE = {
    "torchshard": [
        # meshes
        "Mesh", "create_device_mesh", "current_mesh", "HybridMeshShape",
        "process_index", "process_count", "setup_cpu_emulation",
        # specs and layouts
        "P", "PartitionSpec", "NamedSharding", "TensorSpec", "input_partition_spec",
        "describe_layout", "ShardingLayout", "LayoutBlock", "visualize_sharding",
        # host <-> global
        "host_to_global_array", "host_to_global_specs", "global_to_host_array",
        "replicate_to_local_data",
        # in the step
        "with_sharding_constraint", "maybe_shard", "InputDispatcher", "SpmdInputDispatcher",
        # local views, for steps that compute per process
        "to_local", "to_submesh",
        # feeding from a DataLoader, and feeds from the mesh
        "GlobalBatchLoader", "host_sampler", "sharded_collate", "stream_shard",
        "feed_read_config", "feed_slices",
        # context parallel on the host
        "head_tail_order", "context_parallel_order", "context_parallel_positions",
        # checks across processes
        "set_agreement_check", "set_agreement_deferred", "set_value_check", "call_stream",
        # errors: the base here, every type in torchshard.errors
        "ShardingError", "errors",
        # axlearn compatibility (torchshard._COMPATIBILITY)
        "DataPartitionType", "data_partition_type_to_spec", "complete_partition_spec_tree",
        "dispatch_input_batch", "PHYSICAL_TO_LOGICAL_DISPATCH_KEY",
        "host_to_global_device_array", "infer_mesh_shape",
    ],
    "torchshard.data": [
        "GlobalBatchLoader", "HostSampler", "LoaderStats", "host_sampler", "sharded_collate",
        "stream_shard", "Packer", "context_parallel_rows", "sharded_stream", "ShardedStream",
        "fixed_global_batches", "FixedGlobalBatches",
    ],
    "torchshard.testing": [
        "assert_global_equal", "assert_sharded", "global_batch_loader_per_host",
        "global_to_host_array_per_host", "host_to_global_array_per_host",
        "make_virtual_topology", "virtual_hosts",
    ],
    "torchshard.errors": [
        "ShardingError", "IndivisibleError", "NonUniformShardingError", "NoMeshError",
        "TreeStructureError", "NoProcessGroupError", "ProcessDisagreementError",
        "UnsupportedPartitionError", "CollectiveError", "EmulationError", "WorkerProcessError",
        "MissingDependencyError", "ChildFailedError", "Float64Warning",
    ],
}  # fmt: skip


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_the_public_surface_is_the_listed_one(module):
    assert sorted(module.__all__) == sorted(SURFACE[module.__name__])


def test_the_compatibility_names_are_the_listed_ones():
    assert set(torchshard._COMPATIBILITY) == {
        "DataPartitionType", "data_partition_type_to_spec", "complete_partition_spec_tree",
        "dispatch_input_batch", "PHYSICAL_TO_LOGICAL_DISPATCH_KEY",
        "host_to_global_device_array", "infer_mesh_shape",
    }  # fmt: skip
    assert set(torchshard._COMPATIBILITY) <= set(torchshard.__all__)
    # Each is documented as such: its docstring (the index's row for the constant) says so.
    for name in torchshard._COMPATIBILITY:
        doc = (
            getattr(torchshard, name).__doc__ if name != "PHYSICAL_TO_LOGICAL_DISPATCH_KEY" else ""
        )
        if doc:
            assert "axlearn compatibility" in " ".join(doc.split()), name
    index = " ".join((ROOT / "docs" / "index.md").read_text().split())
    for name in torchshard._COMPATIBILITY:
        row = next(
            line for line in index.split("| `") if line.startswith(name) or f"`{name}" in line
        )
        assert "axlearn compatibility" in row, name


def test_exception_types_are_in_errors_and_only_the_base_at_the_top():
    types = {n for n in torchshard.__all__ if isinstance(getattr(torchshard, n), type)}
    exceptions = {n for n in types if issubclass(getattr(torchshard, n), BaseException)}
    assert exceptions == {"ShardingError"}
    assert torchshard.ShardingError is torchshard.errors.ShardingError


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


def test_every_name_has_its_api_page_and_a_row_in_the_list_of_names():
    """docs/api: one page per concern, each name rendered on exactly one of them (``:::``), and
    docs/api/torchshard.md lists every name with a link to its page."""
    import pathlib
    import re

    import torchshard

    api = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api"
    rendered: dict[str, list[str]] = {}
    for page in sorted(api.glob("*.md")):
        for name in re.findall(r"^::: torchshard\.(\w+)$", page.read_text(), re.M):
            rendered.setdefault(name, []).append(page.name)
    listed = (api / "torchshard.md").read_text()
    # rendered elsewhere: by ::: torchshard.data / .errors, or not code
    elsewhere = {"P", "ShardingError", "errors", "__version__"}
    elsewhere |= {"GlobalBatchLoader", "host_sampler", "sharded_collate"}
    for name in torchshard.__all__:
        assert f"`{name}`" in listed, f"docs/api/torchshard.md does not list {name}"
        if name not in elsewhere:
            assert len(rendered.get(name, [])) == 1, (name, rendered.get(name))
