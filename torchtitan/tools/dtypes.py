"""The config's dtype names (``training.mixed_precision_*``, ``checkpoint.export_dtype``) as
torch dtypes."""

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
