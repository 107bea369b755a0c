"""How many GPUs the NCCL tests of tests/gpu may count on.

With ``HADPSGD_SHARE_GPU`` set (``scripts/gpu_check.sh --part 3`` sets it), the ranks that
share the machine's one GPU run as GPUs of their own, NCCL over sockets on loopback
(:mod:`hadpsgd.comm.share_gpu`): the NCCL tests that need two or four GPUs run on one. A test
about the physical GPUs themselves (which rank binds which device, whose process holds a
context where) needs real ones: :data:`REAL_GPUS`.
"""

from __future__ import annotations

import os

import pytest
import torch

REAL_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
"""The GPUs this machine has."""
SHARED = bool(os.environ.get("HADPSGD_SHARE_GPU", "").strip() not in ("", "0"))
"""Whether the shared-GPU test mode is on for the ranks these tests launch."""
NCCL_GPUS = 4 if SHARED and REAL_GPUS else REAL_GPUS
"""The GPUs the NCCL tests may use: four pretend ones on one GPU in the shared mode."""


def nccl_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless ``n`` GPUs (real, or pretend in the shared-GPU mode) are at hand."""
    return pytest.mark.skipif(NCCL_GPUS < n, reason=f"needs {n} GPUs (or HADPSGD_SHARE_GPU "
                                                    "on one: scripts/gpu_check.sh --part 3)")


def real_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless the machine has ``n`` GPUs (a test of the physical devices)."""
    return pytest.mark.skipif(REAL_GPUS < n or SHARED,
                              reason=f"needs {n} real GPUs, not the shared-GPU mode")
