"""``load_bench(name)``: a ``bench/<name>.py`` script as a module, for tests of its functions.

``bench/`` is a folder of scripts, not a package: each is loaded from its path (its own first lines make its
sibling helpers, ``_common`` and the like, importable).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvfleet_bench_{name}", BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod
