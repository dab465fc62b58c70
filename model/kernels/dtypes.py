"""The short dtype names the kernel tools take on their command lines (`--dtype fp32|bf16|fp16`)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
