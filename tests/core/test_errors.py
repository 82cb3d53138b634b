"""The exception types and the path prefix (torchshard._core.errors): ``at``, the base classes
each type promises, and the public module name the types carry (reprs, tracebacks, pickles).
The golden error texts of the API are in tests/cross/test_error_texts.py."""

import pickle

import pytest

from torchshard._core import errors


def test_at_prefixes_the_path_when_there_is_one():
    assert errors.at("host_arrays['x'][0]", "expected a tensor.") == (
        "host_arrays['x'][0]: expected a tensor."
    )
    assert errors.at("", "expected a tensor.") == "expected a tensor."


@pytest.mark.parametrize(
    ("cls", "bases"),
    [
        (errors.ShardingError, (ValueError,)),
        (errors.IndivisibleError, (errors.ShardingError,)),
        (errors.NonUniformShardingError, (errors.ShardingError,)),
        (errors.NoMeshError, (errors.ShardingError,)),
        (errors.TreeStructureError, (errors.ShardingError,)),
        (errors.NoProcessGroupError, (errors.ShardingError,)),
        (errors.ProcessDisagreementError, (errors.ShardingError,)),
        (errors.CollectiveError, (RuntimeError,)),
        (errors.UnsupportedPartitionError, (TypeError, NotImplementedError)),
        (errors.EmulationError, (RuntimeError,)),
        (errors.WorkerProcessError, (ValueError,)),
        (errors.MissingDependencyError, (ImportError,)),
        (errors.ChildFailedError, (Exception,)),
    ],
)
def test_each_type_is_what_callers_catch(cls, bases):
    assert cls.__bases__ == bases
    e = cls("the message")
    assert str(e) == "the message"
    assert repr(e) == f"{cls.__name__}('the message')"
    assert cls.__module__ == "torchshard.errors"


def test_errors_pickle_through_the_public_module():
    e = errors.IndivisibleError("host_arrays['x']: dim 0 has size 6, not divisible by 8")
    data = pickle.dumps(e)
    assert b"torchshard.errors" in data and b"_core" not in data
    back = pickle.loads(data)
    assert type(back) is errors.IndivisibleError and back.args == e.args


def test_the_helper_loop_variable_is_not_left_behind():
    assert not hasattr(errors, "_cls")
