"""The backend registry: one record per runtime, and the one look-up, ``lookup``.

A backend module builds its ``Backend`` record and calls ``register`` when it is imported.
``KNOWN`` names the module of each backend torchshard ships, so that ``lookup`` can import it
the first time something names it (torch_xla and torch.distributed load only when used); a
third backend is one new module and one line in ``KNOWN``. The lazy import by module name is
the plugin mechanism: it is not an import statement.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import TYPE_CHECKING

from torchshard._backend.protocols import Backend
from torchshard._core.mesh import Mesh

if TYPE_CHECKING:
    import torch

# The backends torchshard ships: name -> the module that registers it when imported.
KNOWN: dict[str, str] = {
    "xla": "torchshard._backend.xla.backend",
    "dtensor": "torchshard._backend.dtensor.backend",
    "torchax": "torchshard._backend.torchax.backend",
}

_BY_NAME: dict[str, Backend] = {}
_LOCK = threading.Lock()


def register(backend: Backend) -> None:
    """Registers ``backend`` under its name (its module calls this when imported)."""
    name = backend.name
    if not isinstance(name, str) or not name:
        raise TypeError(f"register: a backend's name must be a non-empty str, but got {name!r}.")
    with _LOCK:
        if name in _BY_NAME and _BY_NAME[name] is not backend:
            raise ValueError(f"register: a backend called {name!r} is registered already.")
        _BY_NAME[name] = backend


def names() -> tuple[str, ...]:
    """Every backend a mesh may name: the shipped ones, then any registered later."""
    return tuple(KNOWN) + tuple(n for n in _BY_NAME if n not in KNOWN)


def default_name() -> str:
    """The backend of a process when nothing names one (``process_index()`` outside any mesh,
    ``InputDispatcher``'s defaults, ``infer_mesh_shape``).

    ``"xla"`` when torch_xla is imported (the program runs on it); else ``"dtensor"`` when
    torch.distributed's default process group is initialised (one process per device); else
    ``"torchax"`` when torchax is imported (PyTorch on JAX); else ``"xla"`` when torch_xla is
    installed (it is then imported on first use), ``"dtensor"`` when it is not (a plain
    install). Decided on every call, so it follows
    ``init_process_group``; the checks are dictionary lookups (whether torch_xla is installed
    is looked up once per process).
    """
    if sys.modules.get("torch_xla") is not None:
        return "xla"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "dtensor"
    if sys.modules.get("torchax") is not None:
        return "torchax"
    from torchshard._backend.xla.env import xla_installed

    return "xla" if xla_installed() else "dtensor"


def _by_name(name: str) -> Backend:
    backend = _BY_NAME.get(name)
    if backend is not None:
        return backend
    module = KNOWN.get(name)
    if module is None:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(names())}.")
    importlib.import_module(module)  # registers it
    backend = _BY_NAME.get(name)
    if backend is None:
        raise RuntimeError(f"{module} was imported but did not register the backend {name!r}.")
    return backend


def lookup(of: Mesh | str | torch.Tensor | None = None) -> Backend:
    """The (process-wide) backend of ``of``, importing its module on first use.

    - a ``Mesh``: the backend it names (``mesh.backend``);
    - a ``str``: the backend of that name;
    - ``None``: the process's default backend (``default_name``);
    - a tensor: the backend that computes with it in a step: dtensor for a ``DTensor``,
      torchax for a torchax tensor, else xla, whose in-step primitives are plain torch ops,
      right for any other tensor too. This never imports a runtime (a ``DTensor`` or a torchax
      tensor exists only once its module is loaded).
    """
    if isinstance(of, Mesh):
        backend = _BY_NAME.get(of.backend)  # the hot path: one dict read
        return backend if backend is not None else _by_name(of.backend)
    if isinstance(of, str):
        return _by_name(of)
    if of is None:
        return _by_name(default_name())
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(of, dtensor.DTensor):
        return _by_name("dtensor")
    torchax = sys.modules.get("torchax.tensor")
    if torchax is not None and isinstance(of, torchax.Tensor):
        return _by_name("torchax")
    return _by_name("xla")
