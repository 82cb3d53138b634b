"""Deprecation warnings issued once per process (torchshard._core.deprecation): the first call
per key warns, at the caller's line; ``reset`` forgets; keys are independent and thread-safe."""

import threading
import warnings

import pytest

from torchshard._core import deprecation


def _old_api(key="old", message="old is deprecated; use new."):
    deprecation.warn_once(key, message)  # stacklevel 3: the caller of _old_api


@pytest.mark.usefixtures("fresh_deprecations")
def test_the_first_call_warns_at_the_callers_line_and_later_calls_are_silent():
    with pytest.warns(DeprecationWarning, match="^old is deprecated; use new\\.$") as record:
        _old_api()
    assert len(record) == 1
    assert record[0].filename == __file__ and record[0].category is DeprecationWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _old_api()  # the same key: silent
        _old_api(message="another text")  # the key decides, not the text


@pytest.mark.usefixtures("fresh_deprecations")
def test_keys_are_independent_and_reset_forgets_them():
    with pytest.warns(DeprecationWarning) as record:
        _old_api("a", "a is deprecated")
        _old_api("b", "b is deprecated")
    assert [str(w.message) for w in record] == ["a is deprecated", "b is deprecated"]
    deprecation.reset()
    with pytest.warns(DeprecationWarning, match="a is deprecated"):
        _old_api("a", "a is deprecated")


@pytest.mark.usefixtures("fresh_deprecations")
def test_stacklevel_chooses_the_frame():
    with pytest.warns(DeprecationWarning) as record:
        deprecation.warn_once("direct", "direct", stacklevel=1)
    assert record[0].filename == deprecation.__file__


@pytest.mark.usefixtures("fresh_deprecations")
def test_many_threads_warn_once_in_all():
    barrier = threading.Barrier(8, timeout=10)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")

        def call():
            barrier.wait()
            deprecation.warn_once("shared", "shared is deprecated")

        threads = [threading.Thread(target=call, name=f"warn-{i}") for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert [str(w.message) for w in record] == ["shared is deprecated"]
