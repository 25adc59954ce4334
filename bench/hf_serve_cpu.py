"""Run ``transformers serve`` (the real CLI, same arguments) on a machine without ``accelerate``.

``transformers serve`` always loads its model with ``from_pretrained(..., device_map=<--device>)``, and
transformers refuses any ``device_map`` unless ``accelerate`` is installed -- even ``"cpu"``. kvfleet does
not depend on ``accelerate``, so this launcher treats a device map that puts the whole model on the CPU as
no device map at all (``from_pretrained``'s default, which loads on the CPU), then hands over to the
``transformers`` CLI's own ``main``. Nothing else changes: the server, its continuous batching and its
request handling are transformers' code. With ``accelerate`` installed the patch is not applied.

    python -m bench.hf_serve_cpu serve MODEL_DIR --device cpu --dtype float32 --continuous-batching ...
"""

from __future__ import annotations

import sys
from typing import Any


def _cpu_only(device_map: Any) -> bool:
    import torch

    if isinstance(device_map, (str, torch.device)):
        return torch.device(device_map).type == "cpu"
    if isinstance(device_map, dict):
        return all(_cpu_only(v) for v in device_map.values())
    return False


def install_cpu_device_map_patch() -> bool:
    """Make ``from_pretrained`` accept a CPU-only ``device_map`` without ``accelerate``; True if patched."""
    from transformers import modeling_utils
    from transformers.utils import is_accelerate_available

    if is_accelerate_available():
        return False
    original = modeling_utils.check_and_set_device_map

    def check_and_set_device_map(device_map: Any) -> Any:
        if device_map is not None and _cpu_only(device_map):
            return None
        return original(device_map)

    modeling_utils.check_and_set_device_map = check_and_set_device_map
    return True


def main() -> int:
    install_cpu_device_map_patch()
    from transformers.cli.transformers import main as transformers_main

    sys.argv[0] = "transformers"
    return transformers_main()


if __name__ == "__main__":
    sys.exit(main())
