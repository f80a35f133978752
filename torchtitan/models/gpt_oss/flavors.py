"""Named gpt-oss configurations: the published 20B and 120B (dimensions from their Hugging
Face config.json files: vocabulary 201,088, dim 2880, 64 query / 8 KV heads of 64, window 128,
experts of hidden size 2880, top 4) and a CPU-sized debug model."""

from __future__ import annotations

from torchtitan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe

gpt_oss_flavors: dict[str, GptOssModelArgs] = {
    # Tiny and CPU-friendly: heads (8) and KV heads (4) divisible by 4 for TP, 8 experts
    # (EP up to 8) of hidden size 32 (ETP up to 4), a window of 16 tokens (smaller than the
    # debug sequences, so both layer types differ); 264 is the byte tokenizer's vocabulary.
    "debugmodel": GptOssModelArgs(
        vocab_size=264,
        dim=64,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=16,
        attention_window=16,
        moe=gpt_oss_moe(8, 2),
        moe_hidden_dim=32,
        max_seq_len=2048,
    ),
    "20B": GptOssModelArgs(n_layers=24, moe=gpt_oss_moe(32, 4)),
    "120B": GptOssModelArgs(n_layers=36, moe=gpt_oss_moe(128, 4)),
}
