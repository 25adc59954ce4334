import os

# Triton kernels run on CPU only in interpreter mode; this must be set before triton is imported.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # the gateway/operator-only installs have no torch
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
