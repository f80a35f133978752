"""Named Qwen3 configurations: the published dense and MoE sizes (dimensions from their
Hugging Face config.json files; vocabulary 151,936, RoPE theta 1e6, head_dim 128) and
two CPU-sized debug models."""

from __future__ import annotations

from torchtitan.layers.moe import MoEArgs
from torchtitan.models.qwen3.args import Qwen3ModelArgs


def _qwen3_moe(num_experts: int, top_k: int) -> MoEArgs:
    """Softmax top-k routing with renormalised top-k weights, no shared experts, no expert
    bias (as the published models route)."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        top_k=top_k,
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        load_balance_coeff=None,
    )


qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    # Tiny and CPU-friendly; heads (8) and KV heads (4) divisible by 4 for TP, and
    # n_heads * head_dim (128) != dim (64) as in the published models. 264 is the byte
    # tokenizer's vocabulary size.
    "debugmodel": Qwen3ModelArgs(
        vocab_size=264,
        dim=64,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=16,
        ffn_hidden_dim=192,
        max_seq_len=2048,
    ),
    # 8 experts (EP up to 8), top 2; expert hidden size divisible by 4 for ETP.
    "debugmodel_moe": Qwen3ModelArgs(
        vocab_size=264,
        dim=64,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=16,
        ffn_hidden_dim=192,
        moe=_qwen3_moe(8, 2),
        moe_hidden_dim=32,
        max_seq_len=2048,
    ),
    "0.6B": Qwen3ModelArgs(
        dim=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        ffn_hidden_dim=3072,
        tie_word_embeddings=True,
    ),
    "1.7B": Qwen3ModelArgs(
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        ffn_hidden_dim=6144,
        tie_word_embeddings=True,
    ),
    "4B": Qwen3ModelArgs(
        dim=2560,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_dim=9728,
        tie_word_embeddings=True,
    ),
    "8B": Qwen3ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=12288),
    "14B": Qwen3ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_dim=17408),
    "32B": Qwen3ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_dim=25600),
    "30B-A3B": Qwen3ModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_hidden_dim=6144,
        moe=_qwen3_moe(128, 8),
        moe_hidden_dim=768,
    ),
    "235B-A22B": Qwen3ModelArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        ffn_hidden_dim=12288,
        moe=_qwen3_moe(128, 8),
        moe_hidden_dim=1536,
    ),
}
