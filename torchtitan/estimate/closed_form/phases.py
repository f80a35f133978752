"""The peak of each phase of a training step on one pipeline stage: the optimizer step, a
block's backward, the loss backward (full logits or chunked), the pipeline's steady-state
backward and QLoRA's start."""

from __future__ import annotations

from torchtitan.estimate.closed_form.delta_rule import delta_rule_backward_bytes
from torchtitan.estimate.closed_form.feed_forward import ffn_width
from torchtitan.estimate.closed_form.inputs import Layout, Run
from torchtitan.estimate.closed_form.norms import model_norm_kept_bytes
from torchtitan.estimate.closed_form.shapes import block_shapes
from torchtitan.estimate.closed_form.stage import Stage
from torchtitan.layers.loss import auto_chunk_tokens
from torchtitan.protocols.geometry import Geometry

BASE_LOAD = "base load (made NF4 block by block)"  # QLoRA's start: no trace covers it


def stage_phases(
    st: Stage, g: Geometry, lay: Layout, run: Run, first: bool, last: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """(the peak of each phase of a step on this stage, the items it holds at its peak)."""
    a = run.param_bytes
    activations = _in_flight_forwards(lay, run, first) * st.layers * st.kept
    inputs = 16 * run.local_batch * run.seq_len / lay.cp
    # DDP's reducer: flat buckets as large as the gradients, held for the whole run
    ddp_buckets = st.grads if lay.dp_replicate > 1 and not lay.fsdp else 0.0
    base = st.weights + st.opt + st.u_root + inputs + ddp_buckets
    phases = {
        "optimizer step": _optimizer_step(st, g, lay, run, ddp_buckets),
        # the output weight's gradient exists from the loss backward on (the embedding's
        # comes after the blocks)
        "layer backward": _layer_backward(st, g, lay, a, base, run.grad_accum > 1)
        + (a * g.vocab_size * g.dim / lay.tp if last and run.lora is None else 0),
    }
    log_probs = 0.0
    if last:
        log_probs, phases["loss backward"] = _loss_backward(st, g, lay, run, first, base)
        phases["loss backward"] += activations
    if lay.pp > 1:
        phases["pipeline backward"] = _pipeline_backward(
            st, g, lay, run, base, activations, first, last
        )
    if st.base_load:
        phases[BASE_LOAD] = st.base_load
    items = {
        "parameters (sharded fp32; NF4 bases)": st.weights,
        "gathered root parameters": st.u_root,
        "optimizer states": st.opt,
        "DDP gradient buckets": ddp_buckets,
        "activations kept for backward": activations,
        "saved log-probabilities": log_probs,
    }
    return phases, items


def _in_flight_forwards(lay: Layout, run: Run, first: bool) -> int:
    """Micro-batches whose activations a stage holds at once: under 1F1B the warm-up
    forwards (pp on the first stage), under GPipe and LoopedBFS all of them."""
    if lay.pp == 1:
        return 1
    micro = run.microbatches
    return micro if run.pp_all_in_flight else (min(lay.pp, micro) if first else 1)


def _optimizer_step(st: Stage, g: Geometry, lay: Layout, run: Run, ddp_buckets: float) -> float:
    """Weights, gradients and states; the foreach implementation's copy of the gradients,
    Muon's matrices in flight."""
    grads = st.grads
    return (
        st.weights
        + grads
        + st.opt
        + ddp_buckets
        + (grads if run.foreach_optimizer else 0)
        + max(
            _muon_step_bytes(g, lay, run) if run.muon_ns_bytes else 0,
            _low_precision_adam_step_bytes(g, lay, run) if run.state_bytes < 4 else 0,
        )
    )


def _low_precision_adam_step_bytes(g: Geometry, lay: Layout, run: Run) -> float:
    """Adam with moments below fp32 (components/optimizers/adam_states.py) steps one
    parameter at a time through fp32 copies of its two moments and the denominator: three
    fp32 copies of the largest local parameter (the embedding, or a larger block matrix,
    experts as one stack, unless Muon trains those). Muon's AdamW part steps after Muon:
    the larger of the two transients counts."""
    matrices = (
        []
        if run.muon_ns_bytes
        else [
            rows * cols
            for _, delta_rule, moe in g.block_kinds()
            for rows, cols, _ in block_shapes(g, moe, delta_rule)
        ]
    )
    largest = max([g.vocab_size * g.dim, *matrices])
    return 3 * 4 * largest / (lay.dp_shard * lay.cp * lay.tp)


def _muon_step_bytes(g: Geometry, lay: Layout, run: Run) -> float:
    """Muon's step (components/muon._exchange_and_iterate) holds five fp32 whole matrices of
    the largest size at its peak (the one iterated, the next received, the last result sent
    back, this rank's blocks of the next and the last round) and the iteration's copy, Gram
    matrix, its polynomial and next iterate; under FSDP x TP one more (the update and its
    result re-laid out over the second cut). Experts count as one stack."""
    largest = max(
        (rows * cols, min(rows, cols) ** 2)
        for _, delta_rule, moe in g.block_kinds()
        for rows, cols, style in block_shapes(g, moe, delta_rule)
        if cols > 1
    )
    whole, gram = largest
    held = 6 if lay.fsdp and lay.tp > 1 else 5
    return 4 * held * whole + run.muon_ns_bytes * (2 * whole + 2 * gram)


def _layer_backward(
    st: Stage, g: Geometry, lay: Layout, a: int, base: float, accumulating: bool
) -> float:
    """Backward of one block: the blocks below keep their activations, the blocks above hold
    their sharded fp32 gradients (every block's, from the earlier micro-batches, under
    gradient accumulation); plus this block's gathered parameters and the next one's
    (prefetch), its recomputed activations under AC, gradient temporaries, its low-precision
    gradients and fp32 reduce-scatter input. It changes by the same amount from one block to
    the next, so the maximum is at the first or the last block; with blocks of different
    mixers, the maximum over the blocks."""
    mlp_temps = st.tokens * a * (2 * ffn_width(g, lay) + 2 * g.dim)
    delta_rule_temps = delta_rule_backward_bytes(g, lay, st.tokens)
    temps = max(mlp_temps, st.ring_backward, delta_rule_temps) + (a + 4) * st.trained_layer_local
    held = st.grads if accumulating else 0.0

    def gradients_above(blocks: int) -> float:
        return max(held, blocks * 4 * st.trained_layer_sharded)

    if st.blocks is not None:
        peak, below = 0.0, 0.0
        for i, (kept, recompute) in enumerate(st.blocks):
            above = gradients_above(st.layers - 1 - i)
            peak = max(peak, base + 2 * st.u_layer + below + kept + recompute + temps + above)
            below += kept
        return peak
    current = base + 2 * st.u_layer + st.kept + st.recompute + temps
    top_block = current + (st.layers - 1) * st.kept + gradients_above(0)
    bottom_block = current + gradients_above(st.layers - 1)
    return max(top_block, bottom_block)


def _loss_backward(
    st: Stage, g: Geometry, lay: Layout, run: Run, first: bool, base: float
) -> tuple[float, float]:
    """(saved log-probabilities, the loss backward's peak less the kept activations).
    Full logits: fp32 log-probabilities, their gradient and loss parallel's buffers. Chunked
    (``layers/loss.py``): see :func:`_chunked_loss_terms`. Both with the final norm's kept
    bytes and the gradients held from earlier micro-batches."""
    a = run.param_bytes
    chunked = run.loss_chunk != 0
    vocab_local = g.vocab_size / lay.tp if (run.loss_parallel or chunked) else g.vocab_size
    final_norm = st.tokens * (
        model_norm_kept_bytes(g, a, g.dim, run.target) / lay.tp + _output_kept(g, run)
    )
    held = st.grads if run.grad_accum > 1 else 0
    if lay.pp > 1:  # later micro-batches: the stage's gradients and gathered parameters exist
        held = sum(_pipeline_held(st, lay, run, first, True))
        held += _in_flight_loss_inputs(st, g, run, vocab_local)
    start = base + held + final_norm
    if chunked:
        grads, transient = _chunked_loss_terms(st, g, run, vocab_local)
        return 0.0, start + grads + transient + 14 * st.tokens
    loss_k = 3 if (lay.tp > 1 and run.loss_parallel) else 2  # fp32 gradient buffers
    log_probs = 4 * st.tokens * vocab_local
    return log_probs, start + (1 + loss_k) * log_probs


def _output_kept(g: Geometry, run: Run) -> float:
    """Per token, the final norm's output kept by a trained output layer; an adapter on
    the output keeps its middle."""
    a = run.param_bytes
    if run.lora is None:
        return a * g.dim
    return (a * (g.dim + run.lora.rank)) if "output" in run.lora.adapted else 0


def _in_flight_loss_inputs(st: Stage, g: Geometry, run: Run, vocab_local: float) -> float:
    """Under pipeline parallel, what every in-flight micro-batch keeps at the loss: its stage
    output (hidden states) on the chunked loss; its logits (torch's stage) and
    log-probabilities on the full logits."""
    a = run.param_bytes
    in_flight = run.microbatches if run.pp_all_in_flight else 1
    if run.loss_chunk != 0:
        return in_flight * a * st.tokens * g.dim
    return in_flight * a * st.tokens * vocab_local + (in_flight - 1) * 4 * st.tokens * vocab_local


def _chunked_loss_terms(
    st: Stage, g: Geometry, run: Run, vocab_local: float
) -> tuple[float, float]:
    """(gradients, the largest transient) of the chunked loss's backward: the output
    weight's fp32 gradient and the hidden states' gradient; one chunk's fp32 logits (plus
    their low-precision copy), or the weight gradient's low-precision matmuls."""
    a = run.param_bytes
    chunk = (
        run.loss_chunk
        if run.loss_chunk > 0
        else auto_chunk_tokens(int(st.tokens), int(vocab_local), g.dim)
    )
    rows = min(chunk, st.tokens)
    logits = rows * vocab_local * (4 + (a if a < 4 else 0))
    weight_grad = 0.0 if run.lora is not None else vocab_local * g.dim
    transient = logits
    if a < 4:  # the weight gradient sums in fp32 and is cast back at the end; CUDA
        # multiplies each chunk in low precision, CPU casts the chunk to fp32 first
        if run.target == "cuda":
            transient = max(logits, a * (weight_grad + rows * vocab_local))
        else:
            transient = max(logits + 4 * rows * g.dim, a * weight_grad)
    return 4 * weight_grad + a * st.tokens * g.dim, transient


def _pipeline_held(
    st: Stage, lay: Layout, run: Run, first: bool, last: bool
) -> tuple[float, float, float]:
    """What a pipeline stage holds through a step besides weights and optimizer states:
    torch's stage keeps gradients unreduced until the step's last backward (under FSDP
    unsharded, accumulated in fp32, with the parameters left gathered), and one receive
    buffer per micro-batch for the input (non-first stages) and the output gradient
    (non-last stages). Returns (gathered parameters, gradients, receive buffers)."""
    stage_local = st.layers * st.layer_local + st.root_local
    a = run.param_bytes
    params, grads = (a * stage_local, 4 * st.trained_stage_local) if lay.fsdp else (0.0, st.grads)
    boundary = st.a_in  # a micro-batch's block output
    buffers = run.microbatches * boundary * ((not first) + (not last))
    return params, grads, buffers


def _pipeline_backward(
    st: Stage,
    g: Geometry,
    lay: Layout,
    run: Run,
    base: float,
    activations: float,
    first: bool,
    last: bool,
) -> float:
    """A block's backward in the pipeline's steady state: every in-flight micro-batch's
    activations, the stage's held gradients, gathered parameters and buffers, the block's
    recomputation under AC and its gradient temporaries."""
    a = run.param_bytes
    mlp_temps = st.tokens * a * (2 * ffn_width(g, lay) + 2 * g.dim)
    temps = max(mlp_temps, delta_rule_backward_bytes(g, lay, st.tokens))
    temps += (a + 4) * st.trained_layer_local
    return (
        base + sum(_pipeline_held(st, lay, run, first, last)) + activations + st.recompute + temps
    )
