"""Llama 3 flavors used only by benchmarks (load with
``--experimental.custom_import scripts.bench.extra_flavors``, run from the repo root).

- ``dense_like_dsv3_debug``: the dense Llama 3 model with the same *active* parameter count
  as the DeepSeek-V3 ``debugmodel`` (byte tokenizer, vocab 264): 198,208 against 197,952
  (of its 290,112 total; 3 of 8 routed experts per token). Same dim (64), depth (4) and head
  count (4); the FFN hidden size is 128 (the MoE model's dense-layer inter_dim).
"""

from __future__ import annotations

from dataclasses import replace

from torchtitan.models.llama3.flavors import llama3_flavors

llama3_flavors.setdefault(
    "dense_like_dsv3_debug",
    replace(
        llama3_flavors["debugmodel"],
        dim=64,
        n_layers=4,
        n_heads=4,
        vocab_size=264,
        multiple_of=32,
        ffn_dim_multiplier=0.75,
    ),
)

# Llama 3 "1B" dimensions (dim 2048, 32 heads / 8 KV heads, FFN 8192) with 4 of its 16 blocks:
# the same per-block compile (one block graph, reused by every block) and per-block kernels at
# a quarter of the memory (the full 1B model's fp32 weights + grads + AdamW state are ~16 GB
# with the byte tokenizer, too much beside other jobs on a 23 GB machine).
llama3_flavors.setdefault("1B_4layers", replace(llama3_flavors["1B"], n_layers=4))

# Llama 3 "1B" dimensions with one block: the output projection (2048 x 128,256) and the loss
# dominate the step, which is what the chunked-loss benchmark measures; the fp32 weights +
# grads + AdamW state are ~9.4 GB, so seq 8192 still runs on a 24 GB machine.
llama3_flavors.setdefault("1B_1layer", replace(llama3_flavors["1B"], n_layers=1))
