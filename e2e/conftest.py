"""Settings of the whole-platform tests. Their harnesses live in ``kvfleet_devkit`` (the local platform, the pod
runner, the Kubernetes emulator, the Redis server), shared with the operator tests and the benchmarks."""

from __future__ import annotations

import os

# The platform never reaches the Hugging Face Hub: its model is a demo model on local disk.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
