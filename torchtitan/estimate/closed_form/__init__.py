"""Closed-form per-rank peak memory of a decoder described by its ``Geometry``
(``protocols/geometry.py``: grouped-query attention with optional q/k norms and output gate,
latent attention, Gated DeltaNet mixers, dense or MoE feed-forwards under expert parallel,
tied embeddings), for instant sweeps (the planner, mode analytic) and as a cross-check of
the traced figure.

* ``inputs``: the layout and the run besides the geometry (degrees, AC, batch, dtypes, LoRA);
* ``shapes``: the weights of a block and of the root, and their TP/EP-local and FSDP-sharded
  parameter counts;
* ``norms``, ``attention``, ``delta_rule``, ``feed_forward``: what each part of a block keeps
  for backward per token; ``blocks``: a block's activations under activation checkpointing;
* ``stage``: the byte counts of one pipeline stage; ``phases``: the peak of each phase of the
  step; ``peak``: the most loaded stage's peak (``estimate``);
* ``from_config``: the inputs of a configured run.

Assumptions: AdamW (two fp32 states), fp32 master parameters, two training iterations (the
peak is a steady-state step), the model repeats KV heads before attention, and the kernels of
the target device: on CUDA the fused rms_norm saves its input and an fp32 rstd; on CPU the
rms_norm decomposition saves fp32 copies. Accurate to well under 1 % of the trace when the peak
is in the loss backward (the usual case for large vocabularies); approximate when it moves into
the layers' backward or the optimizer step.
"""
