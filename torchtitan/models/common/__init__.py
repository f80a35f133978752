"""Building blocks shared by the models: the decoder skeleton and its initialisation
(``decoder``), RoPE tables with Llama 3.1 scaling and YaRN (``rope``), grouped-query
attention with optional q/k norms (``gqa``), the SwiGLU feed-forward (``feed_forward``),
tensor-parallel plans and the parallelize order (``parallelize``) and Hugging Face key
mapping helpers (``hf``), argument checks and counts (``args``) and the train spec
(``train_spec``). The MoE layer lives in ``torchtitan/models/moe.py``."""
