"""Named Qwen3.5 text configurations: CPU-sized debug models (dense and MoE) and the
published shapes that transformers documents as its defaults (``Qwen3_5TextConfig``: the
Qwen3.5-9B language model; ``Qwen3_5MoeTextConfig``: the Qwen3.5-35B-A3B one), with the
published RoPE theta of 10,000,000."""

from __future__ import annotations

from torchtitan.models.qwen3_5.args import Qwen3_5ModelArgs, qwen3_5_moe

_DEBUG = dict(
    vocab_size=264,  # the byte tokenizer's vocabulary
    dim=64,
    n_layers=4,  # three Gated DeltaNet layers, then one full-attention layer
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    delta_rule_n_k_heads=2,
    delta_rule_n_v_heads=4,
    delta_rule_k_head_dim=16,
    delta_rule_v_head_dim=16,
    delta_rule_chunk_size=16,
    max_seq_len=2048,
)

qwen3_5_flavors: dict[str, Qwen3_5ModelArgs] = {
    # heads (4), KV heads (2), delta-rule key (2) and value heads (4) divisible by 2 for TP
    "debugmodel": Qwen3_5ModelArgs(**_DEBUG, ffn_hidden_dim=192),
    # 8 experts (EP up to 8) of hidden size 32 (ETP up to 4) and a shared expert of 64
    "debugmodel_moe": Qwen3_5ModelArgs(
        **_DEBUG, moe=qwen3_5_moe(8, 2), moe_hidden_dim=32, shared_expert_hidden_dim=64
    ),
    "9B": Qwen3_5ModelArgs(),
    "35B-A3B": Qwen3_5ModelArgs(
        dim=2048,
        n_layers=40,
        n_heads=16,
        n_kv_heads=2,
        moe=qwen3_5_moe(256, 8),
        moe_hidden_dim=512,
        shared_expert_hidden_dim=512,
    ),
}
