"""torchshard.errors, the public module of the exception types (torchshard/errors.py): it
re-exports every type, its docstring's tree is the real hierarchy, and the old top-level names
still work with a DeprecationWarning naming the new place."""

import builtins
import re
import textwrap
import warnings

import pytest

import torchshard as ts
from torchshard import errors
from torchshard._core import errors as core_errors


def test_every_type_is_the_cores_and_is_named_here():
    assert errors.__all__ == sorted(errors.__all__)
    assert len(errors.__all__) == 14
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert cls is getattr(core_errors, name), name
        assert isinstance(cls, type) and issubclass(cls, BaseException | Warning)
        assert cls.__module__ == "torchshard.errors" and cls.__qualname__ == name
    exported = {n for n, v in vars(core_errors).items() if isinstance(v, type)}
    assert exported == set(errors.__all__)  # none left out


def _documented_tree():
    """``{class name: documented parent names}`` from the module docstring's tree."""
    parents, stack = {}, []
    tree = textwrap.dedent(errors.__doc__.split("::", 1)[1].strip("\n"))
    for line in tree.splitlines():
        indent = (len(line) - len(line.lstrip())) // 2
        names = [n.strip() for n in line.strip().split("  ")[0].split(",")]
        stack[indent:] = [names]
        parents.update({n: stack[indent - 1] if indent else [] for n in names})
    return parents


def test_the_documented_hierarchy_is_the_real_one():
    tree = _documented_tree()
    assert set(errors.__all__) <= set(tree)
    assert tree["IndivisibleError"] == ["ShardingError"]
    assert tree["UnsupportedPartitionError"] == ["TypeError", "NotImplementedError"]
    for name in errors.__all__:
        cls = getattr(errors, name)
        for parent in tree[name]:
            base = getattr(errors, parent, None) or getattr(builtins, parent)
            assert issubclass(cls, base), (name, parent)
            assert base in cls.__mro__[1:]


def test_shardingerror_stays_at_the_top_level():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ts.ShardingError is errors.ShardingError
        assert ts.errors is errors


@pytest.mark.parametrize(
    "name", sorted(set(errors.__all__) - {"ShardingError", "Float64Warning"})
)  # Float64Warning came after the move: never a top-level name
def test_the_old_top_level_names_warn_and_still_work(name):
    message = (
        f"torchshard.{name} is deprecated; use torchshard.errors.{name} (the exception types "
        "live in torchshard.errors; torchshard.ShardingError, their base, stays here)."
    )
    with pytest.warns(DeprecationWarning, match=re.escape(message)) as record:
        cls = getattr(ts, name)
    assert cls is getattr(errors, name)
    assert [w.filename for w in record] == [__file__]  # points at the caller


def test_an_unknown_top_level_name_is_an_attribute_error():
    with pytest.raises(
        AttributeError, match=re.escape("module 'torchshard' has no attribute 'NoSuchError'")
    ):
        ts.NoSuchError  # noqa: B018
