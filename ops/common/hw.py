"""Hardware and numeric constants of the Hopper (sm_90) kernels, defined once."""

import torch

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): the kernels' softmax runs in the log2 domain

SMEM_PER_SM = 228 * 1024  # shared memory of one SM, of which 1 KiB per resident CTA is reserved
SMEM_PER_BLOCK = 232448  # the opt-in dynamic shared memory of one CTA (227 KiB)
SMEM_BUDGET = SMEM_PER_BLOCK - 2048  # what an exact shared-memory model may fill: barriers and slack aside
SMEM_LIMIT = 220 * 1024  # what an approximate model may fill: alignment and barriers not counted

# TileLang's names of the torch dtypes the ops take.
TL_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
