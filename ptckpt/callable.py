"""`ptckpt.dump(pid, ...)` and `ptckpt.restore(dir, ...)`: the modules ptckpt.dump and
ptckpt.restore are callable and call the Python API (ptckpt.api).  A package attribute
cannot be both the submodule (which every `import ptckpt.dump` makes it) and a function,
so the module itself answers the call.  Typed code can use ptckpt.api directly."""

from __future__ import annotations

import sys
import types


def make_callable(module_name: str, api_name: str) -> None:
    """Calling module `module_name` calls ptckpt.api.`api_name` (imported at the call)."""

    class _Module(types.ModuleType):
        def __call__(self, *args, **kwargs):
            from . import api
            return getattr(api, api_name)(*args, **kwargs)

    _Module.__call__.__doc__ = f"ptckpt.api.{api_name}: see its documentation."
    sys.modules[module_name].__class__ = _Module
