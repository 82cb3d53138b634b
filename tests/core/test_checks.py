"""The checks several arguments share, each with one wording (torchshard._core.checks):
counts, shapes and host groups; the values they return and their exact messages."""

import re

import numpy as np
import pytest

from torchshard._core import checks


@pytest.mark.parametrize("value", [1, 7, np.int64(3), np.uint8(2)])
def test_positive_int_accepts_ints_of_any_kind(value):
    out = checks.positive_int(value, "prefetch")
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "3", None, np.float32(1)])
def test_positive_int_refuses_the_rest(value):
    with pytest.raises(
        ValueError, match=re.escape(f"prefetch must be a positive int, but got {value!r}.")
    ):
        checks.positive_int(value, "prefetch")


@pytest.mark.parametrize("value", [0, 5, np.int32(0)])
def test_nonnegative_int_accepts_zero(value):
    out = checks.nonnegative_int(value, "workers")
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value", [-1, True, 1.5, "0", None])
def test_nonnegative_int_refuses_the_rest(value):
    with pytest.raises(
        ValueError, match=re.escape(f"workers must be an int >= 0, but got {value!r}.")
    ):
        checks.nonnegative_int(value, "workers")


@pytest.mark.parametrize(
    ("value", "expected"),
    [((8, 3), (8, 3)), ([0], (0,)), ((), ()), (np.array([4, 2]), (4, 2)), (range(3), (0, 1, 2))],
)
def test_shape_returns_a_tuple_of_ints(value, expected):
    out = checks.shape(value, "spec")
    assert out == expected and type(out) is tuple and all(type(n) is int for n in out)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            8,
            TypeError,
            "host_specs['x']: expected a shape (a sequence of ints >= 0), but got 8 of type int.",
        ),
        (
            "83",
            TypeError,
            (
                "host_specs['x']: expected a shape (a sequence of ints >= 0), but got '83' of type "
                "str."
            ),
        ),
        (
            (8, 2.5),
            TypeError,
            (
                "host_specs['x']: every size of a shape must be an int, but dim 1 of (8, 2.5) is "
                "2.5 of type float (sizes count elements: nothing is rounded); pass one int per "
                "dimension."
            ),
        ),
        (
            (True, 2),
            TypeError,
            (
                "host_specs['x']: every size of a shape must be an int, but dim 0 of (True, 2) is "
                "True of type bool (a bool is not a size); pass (1, 2) if that is the shape meant."
            ),
        ),
        (
            (4, -1),
            ValueError,
            "host_specs['x']: every size of a shape must be >= 0, but dim 1 of (4, -1) is -1.",
        ),
    ],
)
def test_shape_errors_name_the_place(value, error, message):
    with pytest.raises(error, match=re.escape(message)):
        checks.shape(value, "host_specs['x']")


def test_shape_without_a_place_starts_with_the_rule():
    with pytest.raises(
        TypeError,
        match=re.escape("expected a shape (a sequence of ints >= 0), but got None of type "),
    ):
        checks.shape(None, "")


@pytest.mark.parametrize(
    ("devices", "hosts", "expected"),
    [
        (8, 1, (0,) * 8),
        (8, 2, (0, 0, 0, 0, 1, 1, 1, 1)),
        (8, 4, (0, 0, 1, 1, 2, 2, 3, 3)),
        (8, 8, tuple(range(8))),
        (6, np.int64(3), (0, 0, 1, 1, 2, 2)),
    ],
)
def test_contiguous_hosts_maps_each_device_to_its_host(devices, hosts, expected):
    assert checks.contiguous_hosts(devices, hosts) == expected


@pytest.mark.parametrize("hosts", [0, 3, -2, 16])
def test_contiguous_hosts_needs_a_divisor(hosts):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"virtual_hosts: num_hosts must be a positive divisor of the 8 devices, but got "
            f"{hosts}; each host owns an equal, contiguous group of device ids."
        ),
    ):
        checks.contiguous_hosts(8, hosts, where="virtual_hosts")


@pytest.mark.parametrize("hosts", [2.0, "2", None, True])
def test_contiguous_hosts_needs_an_int(hosts):
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"num_hosts must be an int, but got {hosts!r} of type {type(hosts).__name__}."
        ),
    ):
        checks.contiguous_hosts(8, hosts)
