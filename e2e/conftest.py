"""Fixtures and import paths of the whole-platform tests.

The Kubernetes emulator (``tests/operator/kube_emulator.py``) and the Redis helper (``tests/redis_server.py``)
are shared with the operator tests, as ``bench/operator.py`` shares them, and the OTLP receiver with the
engine's tracing test (``tests/server/test_tracing.py``): their directories go on ``sys.path`` here (and in
``local_platform.py`` when it runs as a script).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT / "tests", ROOT / "tests" / "operator", ROOT / "tests" / "server", ROOT / "e2e"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

# The platform never reaches the Hugging Face Hub: its model is a demo model on local disk.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
