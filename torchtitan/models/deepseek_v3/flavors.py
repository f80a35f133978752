"""Named DeepSeek-V3-family configurations."""

from __future__ import annotations

from torchtitan.layers.moe import MoEArgs
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs

deepseek_v3_flavors: dict[str, DeepSeekV3ModelArgs] = {
    # Tiny and CPU-friendly: 1 dense + 3 MoE blocks, 8 routed experts (EP up to 8) in 4
    # groups, V3-style sigmoid routing, low-rank queries; head count and hidden sizes
    # divisible by 4 for TP and ETP. 264 is the byte tokenizer's vocabulary size.
    "debugmodel": DeepSeekV3ModelArgs(
        vocab_size=264,
        dim=64,
        inter_dim=128,
        moe_inter_dim=32,
        n_layers=4,
        n_dense_layers=1,
        n_heads=4,
        moe=MoEArgs(
            num_experts=8,
            num_shared_experts=1,
            top_k=3,
            score_func="sigmoid",
            route_norm=True,
            route_scale=1.0,
            num_expert_groups=4,
            num_limited_groups=2,
            load_balance_coeff=1e-3,
        ),
        q_latent_rank=32,
        kv_latent_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_seq_len=2048,
    ),
    # DeepSeek-V2-Lite dimensions (15.7B total, 2.4B active).
    "16B": DeepSeekV3ModelArgs(
        vocab_size=102400,
        dim=2048,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        moe=MoEArgs(
            num_experts=64,
            num_shared_experts=2,
            top_k=6,
            score_func="softmax",
            route_norm=False,
            route_scale=1.0,
            load_balance_coeff=1e-3,
        ),
        q_latent_rank=0,
        kv_latent_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_factor=40.0,
        rope_mscale=0.707,
    ),
    "671B": DeepSeekV3ModelArgs(
        vocab_size=129280,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        moe=MoEArgs(
            num_experts=256,
            num_shared_experts=1,
            top_k=8,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_expert_groups=8,
            num_limited_groups=4,
            load_balance_coeff=1e-3,
        ),
        q_latent_rank=1536,
        kv_latent_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_factor=40.0,
        rope_mscale=1.0,
    ),
}
