"""The torchax backend on real JAX processes: 2 and 4 processes over gloo on this machine's CPU
(8 devices in all), with JAX itself as the oracle (``make_array_from_process_local_data`` and
``process_allgather`` of the same blocks, ``devices_indices_map``; ``_torchax_cases.py``).

Each world size starts one pool of processes for the module (each imports JAX and torch:
several seconds); the case that leaves the processes out of step runs last on its pool.
"""

from __future__ import annotations

import pytest
from helpers import load_conformance
from torchax_env import TORCHAX, needs_torchax

pytestmark = needs_torchax

if TORCHAX:
    from _jax_multiproc import JaxPool

CASES = "_torchax_cases"
HOST_LAYOUTS = load_conformance("host_layouts")["cases"]


@pytest.fixture(scope="module")
def pools():
    made: dict[int, JaxPool] = {}

    def get(n: int) -> JaxPool:
        pool = made.get(n)
        if pool is None or pool.broken or pool.closed:
            pool = made[n] = JaxPool(n)
        return pool

    yield get
    for pool in made.values():
        pool.close()


def run(pools, world, case, /, **kwargs):
    return pools(world).run(f"{CASES}:{case}", **kwargs)


@pytest.mark.parametrize("world", [2, 4])
def test_meshes_and_device_ids_follow_the_processes(pools, world):
    out = run(pools, world, "topology")
    per = 8 // world
    for rank, r in enumerate(out):
        assert r["process"] == r["jax_process"] == (rank, world)
        # JAX numbers process p's CPU devices from 2048 * p; torchshard's ids are 0..7
        assert r["local_jax_ids"] == [2048 * rank + i for i in range(per)]
        assert r["plain"] == r["plain_jax"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        owners = [[(2 * row + c) // per for c in range(2)] for row in range(4)]
        assert r["hybrid_owners"] == owners  # each process's devices form one block
        assert r["axis_types"] == ["AxisType.Auto", "AxisType.Auto"]
        assert r["inside_is_mesh"] and r["after_empty"] and r["from_jax"]


@pytest.mark.parametrize("world", [2, 4])
def test_conformance_vectors_on_real_processes(pools, world):
    cases = [c for c in HOST_LAYOUTS if c["num_hosts"] == world]
    assert len(cases) >= 20
    out = run(pools, world, "conformance", cases=cases)
    errors = {
        "non-uniform": "NonUniformShardingError",
        "indivisible": "IndivisibleError",
    }
    for rank, per in enumerate(out):
        for case in cases:
            got = per[case["id"]]
            if case["valid_input"]:
                assert got == "ok", (rank, case["id"], got)
            else:
                assert got.startswith(errors[case["reject_reason"]]), (rank, case["id"], got)


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "uint8"])
def test_placement_is_jaxs_own_shard_for_shard(pools, dtype):
    out = run(pools, 2, "placement", dtype=dtype)
    whole = [[3 * (i % 8) + j + 100 * (i // 8) for j in range(3)] for i in range(16)]
    if dtype == "bool":
        whole = [[x != 0 for x in row] for row in whole]
    for r in out:
        assert r["type"] == "Tensor" and r["shape"] == (16, 3)
        assert r["problems"] == []  # every addressable shard: JAX's index, JAX's bits
        assert r["dtype"] == ("torch.int32" if dtype == "int64" else f"torch.{dtype}")
        assert r["whole"] == whole


def test_processes_that_disagree_all_raise_the_dtensor_backends_errors(pools):
    out = run(pools, 2, "agreement")
    for r in out:
        assert r["shapes"].startswith("ProcessDisagreementError: host_arrays['x']: every process")
        assert "expected (4, 3) float32 (as on process 0), got (2, 3) float32" in r["shapes"]
        assert "out of step, each in another torchshard call" in r["calls"]
        assert "rank 0: host_to_global_array" in r["calls"]
        assert "rank 1: replicate_to_local_data" in r["calls"]
        assert r["after"] == "[0.0, 1.0]"


def test_the_value_check_names_replicas_that_differ(pools):
    for r in run(pools, 2, "value_check"):
        assert r["same"] == "no error"
        assert r["differ"].startswith("ProcessDisagreementError: host_arrays['w']")
        assert "the ranks [0, 1] hold the same block" in r["differ"]


def test_64_bit_values_without_x64_fail_on_every_process(pools):
    for r in run(pools, 2, "wide_values"):
        assert r["ok"] == "torch.int32 [0, 1, 2, 3, 4, 5, 6, 7]"
        assert r["big"].startswith("ProcessDisagreementError: host_arrays['ids']")
        assert "beyond int32 (1099511627779) on rank 1" in r["big"]
        assert "jax_enable_x64" in r["big"]
        assert r["float64"].startswith("TypeError: host_arrays['f']: a float64 leaf")


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_on_every_process(pools, world):
    out = run(pools, world, "dispatch")
    per = 6
    want = [
        [float(2 * i + 1000 * r), float(2 * i + 1 + 1000 * r)]
        for r in range(world)
        for i in range(per)
    ]
    spmd = [i + 100 * r for r in range(world) for i in range(8)]
    for r in out:
        assert r["shape"] == (per * world, 2)
        assert r["x"] == want
        assert r["spmd"] == spmd


def test_a_torchax_model_consumes_the_global_batch(pools):
    for r in run(pools, 2, "model"):
        assert r == {"type": "Tensor", "spec": "P('data',)", "close": True, "jax_type": "ArrayImpl"}


def _ids(lengths, batch, steps):
    return [
        [
            1000 * r + s * batch + i if s * batch + i < lengths[r] else 0
            for r in range(len(lengths))
            for i in range(batch)
        ]
        for s in range(steps)
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_the_loader_fed_per_process_under_thread_guard(pools, world):
    batch = 8 // world
    lengths = [3 * batch] * world
    out = run(pools, world, "loader", lengths=lengths, batch=batch, policy="error")
    for r in out:
        assert r["problems"] == []
        assert [s["id"] for s in r["steps"]] == _ids(lengths, batch, 3)
        assert {s["type"] for s in r["steps"]} == {"Tensor"}


@pytest.mark.parametrize("world", [2, 4])
def test_the_loader_ends_together_with_last_batch(pools, world):
    batch = 8 // world
    lengths = [3 * batch] * world
    lengths[-1] = 2 * batch + 1  # the last process's source is short
    pad = run(pools, world, "loader", lengths=lengths, batch=batch, policy="pad")
    drop = run(pools, world, "loader", lengths=lengths, batch=batch, policy="drop")
    for r in pad:
        assert r["problems"] == []
        assert [s["id"] for s in r["steps"]] == _ids(lengths, batch, 3)
        last = [i < batch * (world - 1) + 1 for i in range(8)]
        assert [s["mask"] for s in r["steps"]] == [[True] * 8, [True] * 8, last]
    for rank, r in enumerate(drop):
        assert [s["id"] for s in r["steps"]] == _ids(lengths, batch, 2)
        assert r["dropped"] == (1 if rank == world - 1 else batch)


def test_the_loader_resumes(pools):
    for r in run(pools, 2, "resume", n=16, batch=4, take=2):
        ids = _ids([16, 16], 4, 4)
        assert r["taken"] == ids[:2] and r["rest"] == ids[2:]


# The DTensor backend's texts (tests/backend/dtensor/test_backend.py), word for word.
_OUTCOME_MSG = (
    "ProcessDisagreementError: GlobalBatchLoader: batch {n}: every process must make the batch "
    "or end its source at the same batch, but {seen}. Give every process a source that yields "
    "the same number of batches (e.g. torchshard.host_sampler with drop_last=True)."
)


@pytest.mark.parametrize("world", [2, 4])
def test_one_processs_bad_batch_fails_every_process(pools, world):
    """Process 1's DataLoader gives rows of another width from its third batch: process 1
    raises its own check's error, every other process the DTensor backend's disagreement naming
    process 1's failure, at that batch; the batches before it arrived everywhere."""
    batch = 8 // world
    out = run(pools, world, "bad_batch", bad_at=2 * batch)
    others = ", ".join(str(r) for r in range(world) if r != 1)
    seen = f"process{'es' if world > 2 else ''} {others}: a batch; process 1: a failure: "
    for rank, r in enumerate(out):
        assert r["got"] == _ids([16] * world, batch, 2)
        if rank == 1:
            assert r["error"].startswith("ShardingError: GlobalBatchLoader: batch 2: batch['x']")
            assert f"({batch}, 3)" in r["error"]
        else:
            head = _OUTCOME_MSG.format(n=2, seen=seen + "ShardingError: ").split(". Give")[0]
            assert r["error"].startswith(head.split(" ShardingError")[0]), r["error"]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_sources_that_end_at_different_batches_all_raise_as_on_dtensor(pools, prefetch):
    out = run(pools, 2, "loader_outcomes", kind="short", prefetch=prefetch)
    seen = "process 0: a batch; process 1: the end of the source"
    for r in out:
        assert r["got"] == [[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0]]
        assert r["error"] == _OUTCOME_MSG.format(n=2, seen=seen)
        assert r["after"] == [(8, 2)] * 3 and r["stuck"] == []


def test_a_source_that_fails_on_one_process_raises_on_every_process_as_on_dtensor(pools):
    r0, r1 = run(pools, 2, "loader_outcomes", kind="failure", prefetch=2)
    seen = "process 0: a batch; process 1: a failure: ValueError: bad batch 1 on rank 1"
    assert r0["error"] == _OUTCOME_MSG.format(n=1, seen=seen)
    assert r1["error"].startswith("ValueError: bad batch 1 on rank 1 ")
    assert (
        "(the other processes' outcomes differ: "
        + _OUTCOME_MSG.format(n=1, seen=seen).removeprefix("ProcessDisagreementError: ")
        in r1["error"]
    )
    for r in (r0, r1):
        assert r["got"] == [[0.0, 0.0, 10.0, 10.0]]
        assert r["after"] == [(8, 2)] * 3


def test_batches_of_different_shapes_name_the_leaf_as_on_dtensor(pools):
    for r in run(pools, 2, "loader_outcomes", kind="shape0", prefetch=2):
        assert r["error"] == (
            "ProcessDisagreementError: GlobalBatchLoader: batch 0: batch['x']: every process "
            "must pass the same shape and "
            "dtype for a leaf (the global shape is inferred from them); expected (4, 4) float32 "
            "(as on process 0), got (4, 3) float32 on process(es) [1]. Make every process's "
            "input yield the same shapes and dtypes (pad or drop a short last batch, or use "
            "torchshard.InputDispatcher)."
        )
        assert r["after"] == [(8, 2)] * 3


def test_a_process_that_skips_a_call_is_named_within_the_timeout(pools):
    out = run(pools, 2, "skipped_call", timeout=5.0)
    assert out[1]["text"] == "skipped"
    text = out[0]["text"]
    assert text.startswith("CollectiveError: host_to_global_array: torchshard's collective")
    assert "timed out after 5 s" in text and "rank 1 (its last torchshard call" in text
    assert out[0]["took"] < 30
    pools(2).close()  # out of step now: the pool is not reused
