"""The building blocks that models, parallelisms and components all use, below every one of
them: the attention seam and its kernels (``attention``, ``blockwise_attention``), RoPE
tables (``rope``), grouped-query attention (``gqa``), the SwiGLU feed-forward
(``feed_forward``), the MoE layer and router (``moe``), the decoder skeleton (``decoder``),
initialisation by parameter FQN (``init``) and the training loss with ``IGNORE_INDEX``
(``loss``). They import only ``config/`` errors, ``tools/`` and one another."""
