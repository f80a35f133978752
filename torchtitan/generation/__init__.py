"""Text generation from a trained model: sampling with a KV cache (and, for Gated DeltaNet
layers, a recurrent state cache) and checkpoint loading.

The command-line entry point is ``scripts/generate/test_generate.py``.
"""

from torchtitan.generation.generate import generate, sample_next_token
from torchtitan.generation.kv_cache import KVCacheAttention, RecurrentStateCache, kv_cache
from torchtitan.generation.weights import (
    CheckpointError,
    load_model_weights,
    resolve_checkpoint_folder,
)

__all__ = [
    "CheckpointError",
    "KVCacheAttention",
    "RecurrentStateCache",
    "generate",
    "kv_cache",
    "load_model_weights",
    "resolve_checkpoint_folder",
    "sample_next_token",
]
