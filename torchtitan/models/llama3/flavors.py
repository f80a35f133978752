"""Named Llama 3 configurations."""

from __future__ import annotations

from torchtitan.models.llama3.args import TransformerModelArgs

llama3_flavors: dict[str, TransformerModelArgs] = {
    "debugmodel": TransformerModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        vocab_size=2000,
        multiple_of=256,
        rope_theta=500000,
        max_seq_len=2048,
    ),
    # The debug model with Llama 3's 128k vocabulary: the loss dominates its memory (the
    # chunked loss's tests and benchmark).
    "debugmodel_128k": TransformerModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        vocab_size=128256,
        multiple_of=256,
        rope_theta=500000,
        max_seq_len=8192,
    ),
    # Small enough for 8 processes x 10 steps on 2 CPU cores; GQA with head and
    # KV-head counts divisible by 4 so TP up to degree 4 works. 264 is the byte
    # tokenizer's vocabulary size.
    "debugmodel_tiny": TransformerModelArgs(
        dim=64,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=264,
        multiple_of=32,
        rope_theta=500000,
        max_seq_len=2048,
    ),
    # Llama 3.2 1B dimensions (with an untied output layer): fits one GPU for GPU checks.
    "1B": TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
        use_scaled_rope=True,
        rope_scale_factor=32.0,
    ),
    "8B": TransformerModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
        use_scaled_rope=True,
    ),
    "70B": TransformerModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
        use_scaled_rope=True,
    ),
    "405B": TransformerModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
        use_scaled_rope=True,
    ),
}
