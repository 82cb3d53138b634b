"""The index maths is backend-independent: _spec, _mesh, _index, _layout and _topology import and
work with torch, torch_xla and optree unavailable (``sys.modules[name] = None`` makes any import
of them fail).

``torchshard/__init__.py`` re-exports the torch-based API, so the subprocess registers the
package without running it (its ``__path__`` only) and imports the private modules directly.
"""

import pathlib
import subprocess
import sys
import textwrap


def test_index_maths_needs_neither_torch_nor_torch_xla():
    code = textwrap.dedent(
        """
        import importlib.util, sys
        for name in ("torch", "torch_xla", "optree"):
            sys.modules[name] = None
        spec = importlib.util.spec_from_file_location(
            "torchshard", PACKAGE + "/__init__.py", submodule_search_locations=[PACKAGE]
        )
        sys.modules["torchshard"] = importlib.util.module_from_spec(spec)  # not executed
        import numpy as np
        from torchshard._spec import P, DataPartitionType
        from torchshard._mesh import Mesh, current_mesh
        from torchshard._index import NamedSharding
        from torchshard._errors import IndivisibleError
        from torchshard._layout import plan_from_local
        from torchshard._topology import Topology

        mesh = Mesh(np.array([3, 1, 0, 2, 7, 5, 6, 4]).reshape(4, 2), ("data", "model"))
        s = NamedSharding(mesh, P("data", "model"))
        m = s.devices_indices_map((8, 4))
        assert m[3] == (slice(0, 2), slice(0, 2)), m[3]
        assert m[4] == (slice(6, 8), slice(2, 4)), m[4]
        hosts = (0,) * 4 + (1,) * 4
        assert s.process_local_shape((8, 4), 1, device_process=hosts) == (4, 4)
        assert s.global_shape_from_local((4, 4), device_process=hosts) == (8, 4)
        assert s.process_index_and_count(0, process_index=1, device_process=hosts) == (1, 2)
        try:
            s.shard_shape((6, 4))
        except IndivisibleError:
            pass
        else:
            raise AssertionError("expected IndivisibleError")
        plan = plan_from_local(mesh, P("data"), (4, 4), hosts, tuple(range(8)))
        assert plan.global_shape == (8, 4)
        assert Topology(1, 2, hosts).devices_of(1) == (4, 5, 6, 7)
        assert current_mesh() is None
        assert DataPartitionType.FULL.value == "full"
        for name in ("torch", "torch_xla", "optree"):
            assert sys.modules[name] is None, name
        assert not [m for m in sys.modules if m.startswith(("torch.", "torch_xla."))]
        print("pure")
        """
    )
    package = pathlib.Path(__file__).resolve().parents[1] / "torchshard"
    code = f"PACKAGE = {str(package)!r}\n" + code
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "pure"
