"""Deprecation warnings issued once per process (JAX-style ``DeprecationWarning``)."""

from __future__ import annotations

import threading
import warnings

_SEEN: set[str] = set()
_LOCK = threading.Lock()


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> None:
    """Warns ``message`` as a ``DeprecationWarning`` the first time ``key`` is seen."""
    with _LOCK:
        if key in _SEEN:
            return
        _SEEN.add(key)
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def reset() -> None:
    """Forgets which warnings were issued (for tests)."""
    with _LOCK:
        _SEEN.clear()
