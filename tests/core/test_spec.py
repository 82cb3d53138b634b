"""PartitionSpec / P, UNCONSTRAINED and DataPartitionType (torchshard._core.spec)."""

import pickle
import re

import pytest

import torchshard as ts
from torchshard._core.spec import UNCONSTRAINED, as_partition_spec, spec_entry_axes


def test_is_a_tuple_equal_to_the_same_tuple():
    spec = ts.P("data", None, ("fsdp", "model"))
    assert isinstance(spec, tuple)
    assert spec == ("data", None, ("fsdp", "model"))
    assert hash(spec) == hash(("data", None, ("fsdp", "model")))
    assert len(spec) == 3 and spec[2] == ("fsdp", "model")
    assert ts.P is ts.PartitionSpec
    assert ts.P() == () and ts.P(None) == (None,)


def test_list_entries_become_tuples():
    assert ts.P(["a", "b"], None) == (("a", "b"), None)
    assert isinstance(ts.P(["a", "b"])[0], tuple)


def test_a_tuple_of_one_axis_is_that_axis_as_in_jax():
    """JAX 0.10.2: P(("x",)) == P("x"), with the same hash (tests/cross/test_jax.py compares
    with its recorded answers); before, torchshard kept the tuple and the two differed."""
    assert ts.P(("x",)) == ts.P("x") == ("x",)
    assert hash(ts.P(("x",))) == hash(ts.P("x"))
    assert ts.P(["x"], None) == ("x", None)
    assert repr(ts.P(("x",), ("a", "b"))) == "P('x', ('a', 'b'))"
    assert ts.P(("x",)).axes == ("x",)


def test_repr():
    assert repr(ts.P("data")) == "P('data',)"
    assert repr(ts.P("data", None)) == "P('data', None)"
    assert repr(ts.P(("a", "b"))) == "P(('a', 'b'),)"
    assert repr(ts.P()) == "P()"


def test_axes_lists_every_axis_in_order():
    assert ts.P(("a", "b"), None, "c").axes == ("a", "b", "c")
    assert ts.P().axes == ()


def test_immutable_and_pickles():
    spec = ts.P("a", ("b", "c"))
    with pytest.raises(AttributeError):
        spec.extra = 1  # __slots__: no instance attributes
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and type(back) is ts.PartitionSpec


def test_axis_used_twice():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "PartitionSpec ('data', ('model', 'data')) uses mesh axis 'data' twice (entries 0 "
            "and 1); each axis may split at most one dimension."
        ),
    ):
        ts.P("data", ("model", "data"))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            3,
            (
                "PartitionSpec entry 0 must be None, an axis name or a tuple of axis names, "
                "but got 3 of type int."
            ),
        ),
        (
            ("a", 1),
            (
                "PartitionSpec entry 0 must be None, an axis name or a tuple of axis names, "
                "but got ('a', 1) (an element is not a str)."
            ),
        ),
    ],
)
def test_bad_entries(entry, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        ts.P(entry)


def test_subclassing_is_refused():
    with pytest.raises(TypeError, match=re.escape("Subclassing PartitionSpec is not supported.")):

        class _Mine(ts.PartitionSpec):
            pass


def test_unconstrained_is_a_singleton_that_pickles():
    assert ts.PartitionSpec.UNCONSTRAINED is UNCONSTRAINED
    assert type(UNCONSTRAINED)() is UNCONSTRAINED
    assert repr(UNCONSTRAINED) == "UNCONSTRAINED"
    assert pickle.loads(pickle.dumps(UNCONSTRAINED)) is UNCONSTRAINED
    spec = ts.P(UNCONSTRAINED, "x")
    assert spec.axes == ("x",)
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_spec_entry_axes():
    assert spec_entry_axes(None) == ()
    assert spec_entry_axes(UNCONSTRAINED) == ()
    assert spec_entry_axes("a") == ("a",)
    assert spec_entry_axes(("a", "b")) == ("a", "b")


def test_as_partition_spec():
    spec = ts.P("a")
    assert as_partition_spec(spec) is spec
    assert as_partition_spec("a") == ts.P("a")
    assert as_partition_spec(["a", None]) == ts.P("a", None)
    assert as_partition_spec([["a", "b"]]) == ts.P(("a", "b"))


def test_data_partition_type_members():
    assert [t.name for t in ts.DataPartitionType] == ["FULL", "REPLICATED", "BATCH"]
