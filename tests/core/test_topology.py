"""The topology of a run (torchshard._core.topology): the ``Topology`` value and its checks,
and the process-wide overrides that stand in for a backend (``override_topology``, nesting,
removal by identity, per backend)."""

import re
import threading

import pytest

from torchshard._core import topology as _topology
from torchshard._core.topology import Topology, emulated, override, override_topology
from torchshard._mesh.context import current_topology
from torchshard.testing import make_virtual_topology
from torchshard.testing._virtual import is_virtual


def test_topology_validation():
    with pytest.raises(
        ValueError,
        match=re.escape("device_process names processes [0, 5] outside [0, 2)."),
    ):
        Topology(0, 2, (0, 5))


@pytest.mark.xla
def test_equal_overrides_are_removed_by_identity():
    a = make_virtual_topology(8, 2)
    b = make_virtual_topology(8, 2)
    c = make_virtual_topology(8, 4)
    assert a == b and a is not b
    with override_topology(a):
        outer = override_topology(b)
        outer.__enter__()
        with override_topology(c):
            pass
        with override_topology(b):  # an equal object, nested inside b
            pass
        assert current_topology() is b
        outer.__exit__(None, None, None)
        assert current_topology() is a
    assert not is_virtual()


def test_a_topology_is_a_value_with_defaults():
    t = Topology(1, 2, (0, 0, 1, 1))
    assert t.device_count == 4
    assert t.devices_of(0) == (0, 1) and t.devices_of(1) == (2, 3) and t.devices_of(5) == ()
    assert t.data_hosts == (1,) and not t.virtual  # this process's data by default
    assert t == Topology(1, 2, (0, 0, 1, 1), data_hosts=(1,))
    assert hash(t) == hash(Topology(1, 2, (0, 0, 1, 1)))
    assert t != Topology(1, 2, (0, 0, 1, 1), virtual=True)
    assert Topology(0, 2, (0, 1), data_hosts=(0, 1)).data_hosts == (0, 1)
    with pytest.raises(AttributeError):
        t.process_index = 0  # frozen


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((2, 2, (0, 1)), {}, "process_index must be in [0, 2), but got 2."),
        ((-1, 2, (0, 1)), {}, "process_index must be in [0, 2), but got -1."),
        ((0, 0, ()), {}, "process_index must be in [0, 0), but got 0."),
        (
            (0, 2, (0, 1)),
            {"data_hosts": (0, 3)},
            "data_hosts names processes [0, 3] outside [0, 2).",
        ),
    ],
)
def test_topology_checks(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Topology(*args, **kwargs)


def test_overrides_nest_and_apply_to_their_backend_only():
    a = Topology(0, 2, (0, 0, 1, 1), virtual=True)
    b = Topology(1, 4, (0, 1, 2, 3), virtual=True)
    assert override() is None and emulated("xla") is None
    with override_topology(a) as installed:
        assert installed is a
        assert override() == ("xla", a)  # the default backend is torch_xla's
        assert emulated("xla") is a and emulated("dtensor") is None
        with override_topology(b, backend="dtensor"):
            assert override() == ("dtensor", b)
            assert emulated("dtensor") is b
            assert emulated("xla") is None  # only the innermost provider is asked
        assert emulated("xla") is a
    assert override() is None and emulated("xla") is None


def test_an_override_is_removed_when_its_block_raises():
    a = Topology(0, 1, (0, 0))
    with pytest.raises(LookupError), override_topology(a):
        raise LookupError
    assert override() is None


def test_overrides_are_per_thread_and_lent_to_helpers():
    """A thread's providers are its own (before: process-wide, so a thread that installed none
    saw another's, and two threads could not emulate different host counts at once); a
    helper thread installs those of the thread it works for, and leaves with its own again."""
    a = Topology(0, 2, (0, 1), virtual=True)
    b = Topology(0, 4, (0, 1, 2, 3), virtual=True)
    both_in, release = threading.Barrier(3, timeout=10), threading.Event()
    seen = {}

    def emulate(name, topology):
        with override_topology(topology):
            both_in.wait()
            seen[name] = override()[1]
            release.wait(10)
        seen[name + " after"] = override()

    def bystander():
        both_in.wait()
        seen["bystander"] = override()

    threads = [
        threading.Thread(target=emulate, args=("a", a), name="hosts-2"),
        threading.Thread(target=emulate, args=("b", b), name="hosts-4"),
    ]
    for t in threads:
        t.start()
    bystander()
    release.set()
    for t in threads:
        t.join(10)
    assert seen == {"a": a, "b": b, "bystander": None, "a after": None, "b after": None}

    with override_topology(a):
        lent = _topology.providers()
    helper = []

    def work():
        helper.append(override())
        with _topology.installed(lent):
            helper.append(override()[1])
        helper.append(override())

    t = threading.Thread(target=work, name="helper")
    t.start()
    t.join(10)
    assert helper == [None, a, None]
    assert override() is None and _topology.providers() == ()


def test_an_override_ends_its_own_entry_among_equal_ones():
    a = Topology(0, 2, (0, 1), virtual=True)
    twin = Topology(0, 2, (0, 1), virtual=True)
    outer = override_topology(a)
    outer.__enter__()
    inner = override_topology(twin)
    inner.__enter__()
    outer.__exit__(None, None, None)  # removes a, not the twin installed after it
    assert override()[1] is twin
    inner.__exit__(None, None, None)
    assert _topology.providers() == ()
