"""Loading the user's own code by spec string: reward functions (``reward.function``) and rollout
hooks (``rollout.custom_function``) alike. A leaf module (standard library only), so that every
component can load user code without importing another component."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Callable


def load_callable(spec: str) -> Callable:
    """Load ``path/to/file.py:name`` (by path) or ``package.module:name`` (by import)."""
    if ":" not in spec:
        raise ValueError(f"callable spec {spec!r} must look like 'path/to/file.py:fn' or 'package.module:fn'")
    target, attr = spec.rsplit(":", 1)
    if not attr.isidentifier():
        raise ValueError(f"callable spec {spec!r}: {attr!r} is not a valid function name")
    if target.endswith(".py"):
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"file not found: {target} (from spec {spec!r})")
        # A stable, path-derived module name so pickled references and re-loads agree.
        mod_name = "gspo_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"cannot load python file {path}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[mod_name]
                raise
    else:
        module = importlib.import_module(target)
    if not hasattr(module, attr):
        raise AttributeError(f"{target} has no attribute {attr!r} (from spec {spec!r})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"{spec!r} is not callable")
    return fn
