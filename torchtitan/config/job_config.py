"""The job configuration: one dataclass per TOML section, every field documented where it
is defined (the docstring under a field is its ``--help`` text) and checked in its section's
``check(path)`` (``path``: where the section sits, e.g. ``training.dataloader``), which
``check_job_config`` calls once the TOML files and the command line are merged: not in
``__post_init__``, since sections are built from the TOML files before the command line
overrides their values. A check that reads other sections lives in across_sections.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import signal
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from torchtitan.config.checks import (
    AT_LEAST_0,
    AT_LEAST_1,
    IN_0_1,
    IN_0_1_OPEN,
    POSITIVE,
    Rule,
    check_ac_config,
    check_values,
    refuse_until_supported,
    refuse_upstream_only,
    unset_or,
)
from torchtitan.config.errors import ConfigError


@dataclass
class JobSectionConfig:
    config_file: str | None = None
    """TOML job config to load; CLI flags override its values."""

    dump_folder: str = "./outputs"
    """Folder for metrics.jsonl, checkpoints, TensorBoard logs and traces."""

    description: str = "default job"
    """Free-text description of the job."""

    print_config: bool = False
    """Print the merged config at start."""

    save_config_file: str | None = None
    """Write the merged config to this file (relative to job.dump_folder) at start, from
    rank 0: JSON when the name ends in .json, else TOML."""

    custom_config_module: str | None = None
    """Python module with a ``JobConfig`` dataclass whose sections/fields are merged into
    this one, so a custom train spec can read its own settings."""

    use_for_integration_test: bool = False
    """CI trains this config for two steps through run_train.sh, as upstream's CI does with
    the configs it marks (tests/integration_tests/test_config_files.py)."""


@dataclass
class ProfilingConfig:
    enable_profiling: bool = False
    """Record torch profiler traces."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""

    profile_freq: int = 10
    """One profiler cycle every this many steps: it waits, then warms up for
    profiler_warmup steps and records profiler_active steps at the cycle's end."""

    profiler_active: int = 1
    """Steps recorded in each profiler cycle (torch.profiler.schedule's active)."""

    profiler_warmup: int = 3
    """Steps traced but discarded before the recorded ones (torch.profiler.schedule's
    warmup)."""

    enable_memory_snapshot: bool = False
    """Dump CUDA allocator memory snapshots (CUDA only)."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            profile_freq=AT_LEAST_1,
            profiler_active=AT_LEAST_1,
            profiler_warmup=AT_LEAST_0,
        )
        cycle = self.profiler_warmup + self.profiler_active
        if self.enable_profiling and cycle > self.profile_freq:
            raise ConfigError(
                f"profiling.profile_freq ({self.profile_freq}) must be >= profiler_warmup + "
                f"profiler_active ({cycle}); raise profile_freq or shorten the cycle"
            )


@dataclass
class MetricsConfig:
    log_freq: int = 10
    """Log metrics every this many steps (and always at step 1)."""

    enable_tensorboard: bool = False
    """Write TensorBoard scalars."""

    disable_color_printing: bool = False
    """Plain console lines without ANSI colours."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""

    save_for_all_ranks: bool = False
    """Write TensorBoard logs from every rank, not only the rank that owns the loss."""

    enable_wandb: bool = False
    """Log the TensorBoard scalars and the job config to Weights & Biases from the rank that owns
    the loss (pip install 'torchtitan[wandb]'; project from WANDB_PROJECT; WANDB_MODE=offline
    writes the run under job.dump_folder/wandb only)."""

    event_log: bool = False
    """Write each rank's step phases (data, forward_backward, clip_grad_norm, sync, optimizer,
    checkpoint, validation) to job.dump_folder/events/rank-R.jsonl; scripts/timeline.py
    draws them, one lane per rank."""

    straggler_threshold_pct: float = 10.0
    """A rank slower than the median rank by more than this share of a step (in the phases
    without collectives: data, optimizer, checkpoint) is a straggler ..."""

    straggler_log_steps: int = 3
    """... when it is for this many log steps in a row: one warning line names it."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            log_freq=AT_LEAST_1,
            straggler_threshold_pct=POSITIVE,
            straggler_log_steps=AT_LEAST_1,
        )
        if self.enable_wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "metrics.enable_wandb: the wandb package is not installed; "
                "pip install 'torchtitan[wandb]'"
            )


# model.converters names that replace nn.Linear modules, by kind.
_LINEAR_CONVERTERS = {
    "float8": "float8",
    "quantize.linear.float8": "float8",
    "mx": "mx",
    "quantize.linear.mx": "mx",
}


@dataclass
class ModelConfig:
    name: str = "llama3"
    """Registered train spec (model family) to train."""

    flavor: str = "debugmodel"
    """Named size of the model, e.g. debugmodel, 8B, 70B."""

    tokenizer_path: str | None = None
    """Folder with tokenizer.json (+ tokenizer_config.json); unset = built-in byte tokenizer."""

    hf_assets_path: str | None = None
    """Folder of Hugging Face assets (tokenizer, config.json, safetensors)."""

    converters: list[str] = field(default_factory=list)
    """Model converters applied in order before parallelisation (comma-separated)."""

    print_after_conversion: bool = False
    """Print the model after the converters ran."""

    attn_type: Literal["sdpa", "flex"] = "sdpa"
    """Attention kernel: sdpa (causal only) or flex (FlexAttention, any mask type)."""

    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """causal: every token sees all earlier tokens of its sequence; block_causal: only the
    earlier tokens of its own document (packed documents never attend to each other;
    needs attn_type flex)."""

    sliding_window: int | None = None
    """Each token sees at most this many tokens (itself included); unset = no window.
    Needs attn_type flex."""

    def check(self, path: str) -> None:
        """One converter per nn.Linear; masks other than plain causal, and a window, need
        FlexAttention."""
        linear = [name for name in self.converters if name in _LINEAR_CONVERTERS]
        if len(linear) > 1:
            raise ConfigError(
                f"model.converters: {' and '.join(linear)} both convert nn.Linear modules; keep one"
            )
        if self.attn_type == "sdpa" and self.attn_mask_type != "causal":
            raise ConfigError(
                f"model.attn_mask_type {self.attn_mask_type!r} needs model.attn_type 'flex' "
                "(SDPA only masks causally); set --model.attn_type flex"
            )
        if self.sliding_window is not None and self.attn_type != "flex":
            raise ConfigError(
                "model.sliding_window needs model.attn_type 'flex'; set --model.attn_type flex"
            )


DEFAULT_MUON_ADAMW_PARAMS = ("tok_embeddings.*", "output.*", "*.embed_tokens.weight", "lm_head.*")
"""optimizer.muon.adamw_params' default: the token embedding and the output projection (the
native models' names, and transformers' in the hf backend)."""


@dataclass
class MuonConfig:
    """Muon (``optimizer.name = "Muon"``): momentum orthogonalised by a Newton-Schulz
    iteration for the hidden weight matrices (2-D, and MoE experts per expert), with lr and
    weight_decay from ``[optimizer]``; every other trainable parameter (embeddings, output,
    norms, biases, and the weights ``adamw_params`` names) trains with AdamW (betas and eps
    from ``[optimizer]``). Names as in ``torch.optim.Muon``."""

    momentum: float = 0.95
    """Momentum factor."""

    nesterov: bool = True
    """Nesterov momentum: orthogonalise the gradient moved towards the momentum."""

    ns_steps: int = 5
    """Newton-Schulz iterations."""

    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    """The quintic iteration's three coefficients (a, b, c)."""

    ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Dtype of the Newton-Schulz iteration: "auto" is bfloat16 (torch.optim.Muon's) on CUDA
    and on CPUs with native bf16 matmuls, float32 on CPUs that emulate them (measured once
    per machine, as training.cpu_low_precision does)."""

    eps: float = 1e-7
    """Floor of the Frobenius norm the update is divided by before the iteration."""

    adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """Per-matrix lr scale: "match_rms_adamw" 0.2 sqrt(max(rows, cols)) (Moonlight: the
    update's RMS matches AdamW's, so a config tuned for AdamW keeps its lr and weight decay
    when it switches to Muon); "original" sqrt(max(1, rows / cols)) (Keller Jordan's Muon,
    which wants an lr about 50x AdamW's)."""

    adamw_params: list[str] = field(default_factory=lambda: list(DEFAULT_MUON_ADAMW_PARAMS))
    """fnmatch patterns of parameter names (as in the checkpoint) that train with AdamW
    although they are matrices; each pattern beyond the default must match a parameter."""

    adamw_lr: float | None = None
    """Learning rate of the AdamW parameters; unset = optimizer.lr."""

    adamw_weight_decay: float | None = None
    """Weight decay of the AdamW parameters; unset = optimizer.weight_decay."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            momentum=IN_0_1_OPEN,
            ns_steps=Rule(lambda v: 1 <= v < 100, "must be in [1, 100)"),
            ns_coefficients=Rule(lambda v: len(v) == 3, "must be 3 numbers (a, b, c)"),
            eps=POSITIVE,
            adamw_lr=unset_or(POSITIVE),
            adamw_weight_decay=unset_or(AT_LEAST_0),
        )


DEFAULT_WEIGHT_DECAY_EXCLUDE = (
    "*norm.weight",
    "*bias",
    "*.experts.b[123]",
    "tok_embeddings.*",
    "*.embed_tokens.weight",
)
"""optimizer.weight_decay_exclude's default: norms, biases and the token embeddings (the
native models' ``tok_embeddings``, transformers' ``embed_tokens`` in the hf backend)."""


@dataclass
class OptimizerConfig:
    name: Literal["AdamW", "Adam", "Muon"] = "AdamW"
    """Optimizer class."""

    lr: float = 8e-4
    """Peak learning rate."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW) or L2 penalty (Adam)."""

    weight_decay_exclude: list[str] = field(
        default_factory=lambda: list(DEFAULT_WEIGHT_DECAY_EXCLUDE)
    )
    """Parameters trained without weight decay: FQN patterns (fnmatch, names as in the
    checkpoint). The default exempts norms, biases (gpt-oss's expert biases, Qwen3.5's
    dt_bias too) and the token embeddings; [] decays every parameter (upstream's behaviour).
    A pattern you add must match a parameter; the default's need not. Under Muon they apply
    to both its matrices and its AdamW part."""

    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of Adam's and AdamW's moments (with Muon: of its AdamW part's); bfloat16 halves
    their memory, the update is computed in fp32 one parameter at a time
    (optimizer.implementation then does not apply)."""

    lr_multipliers: dict[str, float] = field(default_factory=dict)
    """FQN pattern -> multiplier of the learning rate (and of the schedule) for the matched
    parameters, e.g. {"tok_embeddings.*" = 0.5}; the first matching pattern wins."""

    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Kernel: fused where the device supports it (else foreach, with a notice)."""

    early_step_in_backward: bool = False
    """Step each parameter's optimizer during backward to free its gradient early."""

    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon's settings (only with name = "Muon")."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            lr=POSITIVE,
            eps=POSITIVE,
            weight_decay=AT_LEAST_0,
            beta1=IN_0_1_OPEN,
            beta2=IN_0_1_OPEN,
        )
        self.muon.check(f"{path}.muon")
        for pattern in self.weight_decay_exclude:
            if not pattern.strip():
                raise ConfigError(f"{path}.weight_decay_exclude: an empty pattern; drop it")
        for pattern, factor in self.lr_multipliers.items():
            if not factor > 0:
                raise ConfigError(
                    f"{path}.lr_multipliers: {pattern!r} = {factor} must be > 0 (a parameter "
                    "that should not train is frozen, not given lr 0)"
                )
        refuse_until_supported(self, path, early_step_in_backward="optimizer step in backward")
        if self.name != "Muon":
            self._refuse_muon_settings(path)

    def _refuse_muon_settings(self, path: str) -> None:
        defaults = MuonConfig()
        for name in defaults.__dataclass_fields__:
            if getattr(self.muon, name) != getattr(defaults, name):
                raise ConfigError(
                    f"optimizer.muon.{name}: a Muon setting, but optimizer.name is "
                    f"{self.name!r}; set optimizer.name = 'Muon' or drop it"
                )


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 200
    """Linear warmup steps."""

    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (Warmup-Stable-Decay); unset = decay
    right after warmup."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""

    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""

    total_steps: int | None = None
    """Length of the schedule in steps (warmup and decay are placed within it); unset =
    training.steps. Steps past it keep the final learning rate."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            warmup_steps=AT_LEAST_0,
            decay_ratio=unset_or(IN_0_1),
            min_lr_factor=IN_0_1,
            total_steps=unset_or(AT_LEAST_1, "must be >= 1 (unset = training.steps)"),
        )


@dataclass
class DataLoaderConfig:
    num_workers: int = 0
    """Worker processes per rank that tokenize and pack the data (0: the training process does
    it). Training only (validation reads in the training process); must divide
    training.data_shards / dp degree. Batches, their order and the checkpointed data state are
    those of num_workers = 0."""

    persistent_workers: bool = False
    """Keep the workers, and what they prefetched, from one iteration of the loader to the next
    (needs num_workers > 0); without it each iteration starts new workers."""

    pin_memory: bool = False
    """Pin host memory of batches (where an accelerator is present; a warning otherwise)."""

    prefetch_factor: int | None = None
    """Batches each worker prepares ahead (default 2; needs num_workers > 0); at most
    num_workers x prefetch_factor batches wait in host memory."""

    def check(self, path: str) -> None:
        check_values(self, path, num_workers=AT_LEAST_0)
        for name in ("prefetch_factor", "persistent_workers"):
            if getattr(self, name) not in (None, False) and self.num_workers == 0:
                raise ConfigError(f"{path}.{name}: needs {path}.num_workers > 0")
        check_values(self, path, prefetch_factor=unset_or(AT_LEAST_1))


@dataclass
class HFDatasetConfig:
    """How to read a Hugging Face dataset (``dataset = "hf"``; ``dataset_path`` is a hub id, a
    local folder or file of parquet/arrow/jsonl/json/csv/txt files, or a ``save_to_disk``
    folder)."""

    name: str | None = None
    """The dataset's configuration name (e.g. sample-10BT of FineWeb-Edu); unset = its default."""

    split: str = "train"
    """The split to read."""

    text_column: str = "text"
    """The column holding each document's text."""

    messages_column: str | None = None
    """Chat data instead of text: the column holding each sample's messages (a list of
    {"role", "content"}), trained on the assistant turns as the sft dataset is."""

    streaming: bool = False
    """Stream the rows instead of loading the split into Hugging Face's Arrow cache: data shard
    s reads the s-th contiguous group of the dataset's files (so training.data_shards may not
    exceed the file count) and resumes at its row."""

    def check(self, path: str) -> None:
        for name in ("split", "text_column"):
            if not getattr(self, name):
                raise ConfigError(f"{path}.{name}: must not be empty")


@dataclass
class DataSourceConfig:
    """One source of a data mixture (a ``[[training.dataset_mixture]]`` table)."""

    dataset: str = "tokens"
    """A registered dataset: tokens (a token store, by random access), hf (a Hugging Face
    dataset) or a text dataset (packed per data shard; each rank reads its own shards of it,
    with training.data_shards divisible by the dp degree)."""

    dataset_path: str | None = None
    """The store folder (tokens) or the text dataset's files."""

    weight: float = 1.0
    """Share of every global batch (normalised over the sources)."""

    max_epochs: float | None = None
    """Stop taking from this source after this many passes over it; unset = never."""

    name: str | None = None
    """Name in metrics and validation results; unset = the folder name of dataset_path, else
    the dataset name."""

    hf: HFDatasetConfig = field(default_factory=HFDatasetConfig)
    """With dataset = "hf": how to read it."""

    def check(self, path: str) -> None:
        self.hf.check(f"{path}.hf")
        check_values(
            self,
            path,
            weight=POSITIVE,
            max_epochs=unset_or(POSITIVE, "must be > 0 (unset = no cap)"),
        )
        if self.dataset == "mixture":
            raise ConfigError(f"{path}.dataset: a source cannot be a mixture itself")


def _apply_mixture_flag(data: TrainingConfig | ValidationConfig, path: str) -> None:
    if data.mixture is not None:
        data.dataset_mixture = parse_mixture_flag(data.mixture, f"{path}.mixture")
        data.dataset = "mixture"


def _check_mixture(dataset: str, mixture: list[DataSourceConfig], path: str) -> None:
    """A mixture is dataset = "mixture" with its sources, each checked, named once."""
    if (dataset == "mixture") != bool(mixture):
        raise ConfigError(
            f'{path}.dataset_mixture: a mixture is {path}.dataset = "mixture" with its '
            f"[[{path}.dataset_mixture]] sources; set both or neither"
        )
    names = []
    for index, source in enumerate(mixture):
        source.check(f"{path}.dataset_mixture[{index}]")
        names.append(
            source.name
            or (Path(source.dataset_path).name if source.dataset_path else source.dataset)
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(
            f"{path}.dataset_mixture: two sources are named {repeated[0]!r}; give each a "
            "distinct name"
        )


MIXTURE_FLAG_SYNTAX = (
    "sources separated by ';', each comma-separated key=value pairs with the keys of a "
    "[[dataset_mixture]] table (dataset, dataset_path, weight, max_epochs, name, hf.name, "
    "hf.split, hf.text_column, hf.messages_column, hf.streaming), e.g. "
    "'dataset=tokens,dataset_path=stores/web,weight=0.7;dataset=tokens,"
    "dataset_path=stores/code,weight=0.3'"
)


def _flag_value(text: str) -> str | int | float | bool:
    """A value as TOML reads it (0.7, true, 3), else the text itself (a path, a name)."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _typed(section: object, key: str, value: object, where: str) -> object:
    """``value`` for field ``key`` of ``section``: a number where the field is one."""
    default = getattr(section, key)
    if (
        key in ("weight", "max_epochs")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    ):
        return float(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if key in ("weight", "max_epochs"):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    return str(value)


def parse_mixture_flag(text: str, path: str) -> list[DataSourceConfig]:
    """The sources of a mixture given on the command line (see ``MIXTURE_FLAG_SYNTAX``)."""
    sources = []
    parts = [part.strip() for part in text.split(";") if part.strip()]
    if not parts:
        raise ConfigError(f"{path}: no sources; write {MIXTURE_FLAG_SYNTAX}")
    for index, part in enumerate(parts):
        where = f"{path}: source {index} ({part!r})"
        source = DataSourceConfig()
        for pair in part.split(","):
            key, equals, value = (item.strip() for item in pair.partition("="))
            if not equals or not key or not value:
                raise ConfigError(
                    f"{where}: {pair.strip()!r} is not key=value; write {MIXTURE_FLAG_SYNTAX}"
                )
            target, name = (source.hf, key[3:]) if key.startswith("hf.") else (source, key)
            if name == "hf" or not any(f.name == name for f in dataclasses.fields(target)):
                raise ConfigError(f"{where}: unknown key {key!r}; write {MIXTURE_FLAG_SYNTAX}")
            setattr(target, name, _typed(target, name, _flag_value(value), f"{where}: {key}"))
        sources.append(source)
    return sources


# Datasets read by random access, which a shuffle needs.
_RANDOM_ACCESS = ("tokens", "mixture")


@dataclass
class TrainingConfig:
    dataset: str = "python_stdlib"
    """Registered dataset; python_stdlib is embedded (needs no download); tokens reads a token
    store made by scripts/data/prepare.py; mixture blends the sources of
    dataset_mixture."""

    dataset_path: str | None = None
    """Local path for file datasets (json, jsonl, parquet, txt), the token store (tokens), or
    the Hugging Face dataset (hf: a hub id or a local folder)."""

    hf: HFDatasetConfig = field(default_factory=HFDatasetConfig)
    """With dataset = "hf": configuration name, split, column, streaming."""

    local_batch_size: int = 8
    """Sequences per rank per micro-batch."""

    global_batch_size: int = -1
    """Sequences per optimizer step; -1 = local_batch_size x data-parallel degree. A
    multiple of that product gives gradient accumulation."""

    seq_len: int = 2048
    """Tokens per sequence."""

    max_norm: float = 1.0
    """Gradient clipping max norm."""

    reset_position_ids_per_document: bool = False
    """RoPE positions restart at 0 at every document start (needs model.attn_mask_type
    block_causal)."""

    steps: int = 10000
    """Training steps."""

    enable_cpu_offload: bool = False
    """Offload FSDP parameters, gradients and optimizer states to CPU."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of parameters, gradients and optimizer states. bfloat16 = full bf16 training:
    no float32 master copy (needs mixed_precision_param bfloat16)."""

    mixed_precision_param: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Parameter dtype for compute under FSDP or autocast."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Gradient reduce-scatter dtype under FSDP."""

    gc_freq: int = 50
    """Python garbage collection every this many steps."""

    gc_debug: bool = False
    """Collect every step and warn about tensor reference cycles."""

    data_shards: int = 64
    """Fixed number of data shards; the data-parallel degree must divide it. Data order
    depends on it, never on the parallel layout."""

    skip_nonfinite_steps: bool = False
    """Skip (instead of stopping at) a step whose loss or grad norm is not finite."""

    cpu_keep_freed_memory: bool = True
    """Training on the CPU (glibc): memory that tensors free stays with the process for the
    next step instead of going back to the OS, which would fault it in and zero it again
    (benchmark preset, 1 process: ~8% more tokens/s, half the system time); the peak RSS
    is higher (+15% there). No effect on CUDA."""

    dataset_mixture: list[DataSourceConfig] = field(default_factory=list)
    """With dataset = "mixture": the sources ([[training.dataset_mixture]] tables, or the
    mixture flag) and their weights; every global batch takes from each source as close to its
    weight as whole samples allow, the same under every data-parallel layout."""

    mixture: str | None = None
    """A mixture on the command line: replaces dataset_mixture and sets dataset = "mixture".
    Sources separated by ';', each key=value pairs with the table's keys:
    "dataset=tokens,dataset_path=stores/web,weight=0.7;dataset=hf,dataset_path=data/code,weight=0.3"."""

    shuffle_seed: int | None = None
    """Shuffle the order of the packed sequences with this seed (token stores only: the
    permutation needs random access); unset = data order."""

    shuffle_window: int = 0
    """Sequences shuffled among each other: consecutive blocks of this many; 0 = a whole pass
    over each store."""

    loss_chunk_size: int = -1
    """Cross-entropy without the full logits: the output projection and the loss run this
    many tokens at a time, the backward recomputes each chunk's logits (layers/loss.py); the
    numbers are those of the full path. -1 = ceil(vocabulary / dim) chunks per micro-batch
    (the local vocabulary under tensor parallel), or the full path where the output layer is
    float8 or carries LoRA adapters; 0 = the full logits."""

    loss_kernel: Literal["native", "liger"] = "native"
    """The chunked loss's kernel: native (every device and layout), or liger (Liger Kernel's
    fused linear cross-entropy; CUDA with liger-kernel installed, no tensor parallel)."""

    cpu_low_precision: Literal["auto", "force"] = "auto"
    """Training on the CPU: "auto" computes in bfloat16 / float16 (mixed_precision_param,
    mixed_precision_reduce, dtype) only where this CPU runs that dtype's matmuls natively
    (measured once per machine), else in float32, said in one line at start (a CPU without
    bf16 instructions emulates them, ~80x slower than float32); "force" keeps the dtypes as
    configured. No effect on CUDA."""

    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    """Data loader keyword arguments."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            steps=AT_LEAST_1,
            local_batch_size=AT_LEAST_1,
            global_batch_size=Rule(lambda v: v == -1 or v >= 1, "must be -1 (auto) or >= 1"),
            seq_len=AT_LEAST_1,
            max_norm=POSITIVE,
            gc_freq=AT_LEAST_1,
            data_shards=AT_LEAST_1,
            loss_chunk_size=Rule(
                lambda v: v >= -1, "must be -1 (auto), 0 (full logits) or the tokens per chunk"
            ),
        )
        self.dataloader.check(f"{path}.dataloader")
        self.hf.check(f"{path}.hf")
        if self.dtype == "bfloat16" and self.mixed_precision_param != "bfloat16":
            # full bf16 training keeps bf16 parameters: computing in another dtype makes no sense
            raise ConfigError(
                f"training.mixed_precision_param={self.mixed_precision_param!r} with "
                "training.dtype='bfloat16': parameters are already bf16; set mixed_precision_param "
                "to bfloat16 or training.dtype to float32"
            )
        if self.loss_kernel == "liger" and self.loss_chunk_size == 0:
            raise ConfigError(
                "training.loss_kernel='liger': is a chunked loss; training.loss_chunk_size=0 asks "
                "for the full logits (set it to -1 or leave loss_kernel at 'native')"
            )
        _apply_mixture_flag(self, path)
        _check_mixture(self.dataset, self.dataset_mixture, path)
        check_values(
            self, path, shuffle_window=Rule(lambda v: v >= 0, "must be >= 0 (0 = a whole pass)")
        )
        if self.shuffle_seed is not None and self.dataset not in _RANDOM_ACCESS:
            raise ConfigError(
                "training.shuffle_seed: shuffling reads sequences out of order, which needs a "
                f"token store; prepare {self.dataset!r} once (python scripts/data/prepare.py) and "
                "train with --training.dataset tokens"
            )


@dataclass
class ParallelismConfig:
    data_parallel_replicate_degree: int = 1
    """Replicas (DDP, or the replicate dimension of HSDP)."""

    data_parallel_shard_degree: int = -1
    """FSDP shards; -1 = whatever the other degrees leave of the world size."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: default = yes except under pipeline parallel."""

    enable_compiled_autograd: bool = False
    """Compile the backward with compiled autograd."""

    tensor_parallel_degree: int = 1
    """Tensor (+ sequence) parallel degree."""

    disable_loss_parallel: bool = False
    """Gather the vocab-sharded logits before the loss instead of loss parallel."""

    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (CUDA + compile only)."""

    pipeline_parallel_degree: int = 1
    """Pipeline stages across ranks."""

    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Layer FQNs where a new stage starts, e.g. layers.4 (comma-separated)."""

    module_fqns_per_model_part: list[list[str]] | None = None
    """Not supported here (use pipeline_parallel_split_points); only the default is accepted."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Layers per stage (embedding and output count as one each); unset = even split."""

    pipeline_parallel_first_stage_less_layers: int = 1
    """Layers fewer on the first stage (it holds the embedding)."""

    pipeline_parallel_last_stage_less_layers: int = 1
    """Layers fewer on the last stage (it holds norm and output)."""

    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule name (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    ZBVZeroBubble)."""

    pipeline_parallel_schedule_csv: str = ""
    """CSV file defining a custom pipeline schedule."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch."""

    pipeline_parallel_expert_parallel_overlap: bool = True
    """Upstream's DualPipeV EP/PP overlap; not supported here, only the default is accepted."""

    context_parallel_degree: int = 1
    """Ranks that split each sequence (context parallel)."""

    context_parallel_rotate_method: Literal["allgather", "alltoall", "ulysses"] = "allgather"
    """How context-parallel ranks exchange keys/values."""

    context_parallel_load_balancer: Literal["headtail", "none"] = "headtail"
    """Sequence chunk placement for causal-attention load balance."""

    expert_parallel_degree: int = 1
    """Expert parallel degree (borrowed from data_parallel_shard x context parallel)."""

    expert_tensor_parallel_degree: int = 1
    """Tensor parallel degree inside experts: 1 or tensor_parallel_degree."""

    expert_parallel_comm_backend: Literal["standard", "deepep"] = "standard"
    """Expert-parallel all-to-all: standard (torch collectives); deepep is not supported here."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            data_parallel_replicate_degree=AT_LEAST_1,
            data_parallel_shard_degree=Rule(
                lambda v: v == -1 or v >= 1, "must be -1 (infer) or >= 1"
            ),
            tensor_parallel_degree=AT_LEAST_1,
            pipeline_parallel_degree=AT_LEAST_1,
            context_parallel_degree=AT_LEAST_1,
            expert_parallel_degree=AT_LEAST_1,
            expert_tensor_parallel_degree=AT_LEAST_1,
            pipeline_parallel_microbatch_size=AT_LEAST_1,
        )
        refuse_until_supported(self, path, enable_compiled_autograd="compiled autograd")
        refuse_upstream_only(
            self,
            path,
            module_fqns_per_model_part=(
                "pipeline stages by module lists (use pipeline_parallel_split_points)"
            ),
            pipeline_parallel_expert_parallel_overlap="the DualPipeV EP/PP overlap",
            expert_parallel_comm_backend="DeepEP dispatch",
        )
        etp, tp = self.expert_tensor_parallel_degree, self.tensor_parallel_degree
        if etp not in (1, tp):
            raise ConfigError(
                "parallelism.expert_tensor_parallel_degree: must be 1 or tensor_parallel_degree "
                f"({tp}), got {etp}"
            )


_CHECKPOINT_STATES = ("model", "optimizer", "lr_scheduler", "dataloader", "rng", "train_state")


@dataclass
class CheckpointConfig:
    enable: bool = False
    """Save and load checkpoints."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""

    interval: int = 500
    """Save every this many steps."""

    initial_load_path: str | None = None
    """Checkpoint to start from when the checkpoint folder has none."""

    initial_load_model_only: bool = True
    """Load only model weights from initial_load_path."""

    initial_load_in_hf: bool = False
    """initial_load_path (or model.hf_assets_path) holds Hugging Face safetensors."""

    initial_load_in_hf_quantized: bool = False
    """Quantized Hugging Face checkpoints are not supported here; only the default is accepted."""

    enable_ft_dataloader_checkpoints: bool = True
    """Under fault tolerance, save each replica group's data-loader position after every
    step, so that a group that rejoins neither repeats nor skips samples."""

    last_save_model_only: bool = True
    """At the last step save only the model weights (in export_dtype)."""

    last_save_in_hf: bool = False
    """At the last step save Hugging Face safetensors + config.json."""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the model-only export."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background."""

    keep_latest_k: int = 10
    """Keep this many newest complete checkpoints; 0 = keep all."""

    load_step: int = -1
    """Step to load; -1 = newest complete checkpoint."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """States not to load, e.g. optimizer,lr_scheduler,dataloader (comma-separated)."""

    enable_first_step_checkpoint: bool = False
    """Also save after step 1."""

    create_seed_checkpoint: bool = False
    """Write the initial weights as step-0 and exit (one process)."""

    load_only: bool = False
    """Load but never save."""

    preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals that make every rank finish its step, save a checkpoint and exit 0."""

    max_failures_at_same_step: int = 3
    """Under run_train.sh with MAX_RESTARTS: once a rank has failed this many times at the
    same step (each restart resumed from the newest checkpoint and failed again there), the
    run stops with one error line instead of restarting again."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            interval=AT_LEAST_1,
            keep_latest_k=Rule(lambda v: v >= 0, "must be >= 0 (0 keeps all)"),
            max_failures_at_same_step=AT_LEAST_1,
        )
        refuse_upstream_only(
            self, path, initial_load_in_hf_quantized="loading quantized Hugging Face checkpoints"
        )
        unknown = [n for n in self.exclude_from_loading if n not in _CHECKPOINT_STATES]
        if unknown:
            raise ConfigError(
                f"checkpoint.exclude_from_loading: unknown state(s) {', '.join(unknown)}; choose "
                f"from {', '.join(_CHECKPOINT_STATES)}"
            )
        for name in ("initial_load_in_hf", "last_save_in_hf", "initial_load_path"):
            if getattr(self, name) and not self.enable:
                raise ConfigError(f"checkpoint.{name}: needs checkpoint.enable")
        unknown = [
            n
            for n in self.preemption_signals
            if not isinstance(getattr(signal, n, None), signal.Signals)
        ]
        if unknown:
            raise ConfigError(
                "checkpoint.preemption_signals: unknown signal(s) "
                f"{', '.join(map(repr, unknown))}; use names such as SIGTERM or SIGUSR1"
            )


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective", "memory_budget"] = "none"
    """Recompute activations in backward: none, full (every block), selective, or
    memory_budget (the compiler chooses what to recompute: needs compile.enable)."""

    selective_ac_option: str = "2"
    """For selective: N = every N-th block, or "op" = per-op policy."""

    preserve_rng_state: bool = False
    """Replay the forward's RNG state during recomputation (needed only if the model draws
    random numbers in forward, e.g. dropout)."""

    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(
        default_factory=lambda: ["moe.router.gate"]
    )
    """Not supported here; only the default is accepted."""

    early_stop: bool = False
    """Not supported here; only the default is accepted."""

    memory_budget: float = 0.5
    """For mode memory_budget, in [0, 1]: the share of the activations the compiled blocks
    keep for backward (torch's min-cut partitioner; 0 recomputes all it can, 1 none)."""

    visualize_memory_budget_pareto: bool = False
    """Upstream's memory_budget mode; not supported here, only the default is accepted."""

    determinism_check: str = "default"
    """Not supported here; only the default is accepted."""

    debug: bool = False
    """Not supported here; only the default is accepted."""

    save_attention_output: Literal["selective", "always", "never"] = "selective"
    """Whether blocks recomputed whole keep their attention output (one [tokens, heads x
    head_dim] tensor and the fp32 log-sum-exp per block) instead of recomputing attention in
    backward, the costliest op to recompute. "selective" (default): the blocks that selective
    every-N AC recomputes keep it, full AC (whose purpose is the least memory) does not, and
    nor does ring context parallelism (alltoall), which would keep every ring step's partial
    output; "always": also under full AC and ring CP (there up to cp partial outputs per
    block); "never": recompute whole blocks, as upstream's layer-level AC does. The "op"
    policy always keeps it."""

    def check(self, path: str) -> None:
        refuse_upstream_only(
            self,
            path,
            per_op_sac_force_recompute_mm_shapes_by_fqns="forced matmul recompute by FQN",
            early_stop="early-stopped recomputation",
            visualize_memory_budget_pareto="the memory budget's Pareto plot",
            determinism_check="recomputation determinism checks",
            debug="activation-checkpoint debug mode",
        )
        error = check_ac_config(self.mode, self.selective_ac_option)
        if error:
            raise ConfigError(error)
        check_values(self, path, memory_budget=IN_0_1)


@dataclass
class CompileConfig:
    enable: bool = False
    """torch.compile each transformer block (and the loss)."""

    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What to compile (comma-separated)."""

    backend: str = "inductor"
    """torch.compile backend."""


@dataclass
class Float8LinearConfig:
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """Scaling recipe: tensorwise (one scale per tensor; also what None means), rowwise (one
    per row) or rowwise_with_gw_hp (rowwise, weight gradient in high precision)."""

    filter_fqns: list[str] = field(default_factory=list)
    """Linears whose FQN contains one of these strings stay in high precision
    (comma-separated), e.g. output,router. Linears with a dimension not divisible by 16
    always stay."""

    emulate: bool = False
    """Emulate float8 matmuls in high precision (for CPUs and GPUs below SM89; testing only)."""

    enable_fsdp_float8_all_gather: bool = False
    """FSDP all-gathers the weights in float8 (half the bytes of bf16); tensorwise only."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute the float8 scales of all FSDP weights in one kernel after each optimizer
    step (needs enable_fsdp_float8_all_gather)."""

    force_recompute_fp8_weight_in_bwd: bool = False
    """Upstream's (2025-07) float8 weight recompute; not supported here, only the default is
    accepted."""

    moe_fqns_prototype: list[str] = field(default_factory=list)
    """Upstream's (2025-07) float8 MoE prototype; only the default is accepted (use
    quantize.grouped_mm.float8.fqns)."""

    @property
    def recipe(self) -> str:
        """The recipe in use (None means tensorwise, as upstream)."""
        return self.recipe_name or "tensorwise"

    def check(self, path: str) -> None:
        refuse_upstream_only(
            self,
            path,
            force_recompute_fp8_weight_in_bwd="forced float8 weight recomputation",
            moe_fqns_prototype="float8 MoE prototype (use quantize.grouped_mm.float8.fqns)",
        )


@dataclass
class MXLinearConfig:
    recipe_name: Literal["mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8", "mxfp8_cublas"] = (
        "mxfp8_rceil"
    )
    """MXFP8 recipe (blocks of 32 share an e8m0 scale; needs SM100 unless emulate). Upstream's
    names for older torchao (mxfp8, mxfp8_cublas) load but are refused when MX is enabled."""

    use_fp8_dim1_cast_triton_kernel: bool = True
    """Upstream's (2025-07) MX cast-kernel switch; only the default is accepted."""

    mxfp8_dim1_cast_kernel_choice: Literal["triton", "cuda", "torch"] = "triton"
    """Upstream's (v0.2.2) MX cast-kernel choice; only the default is accepted."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linears whose FQN contains one of these strings stay in high precision (comma-separated)."""

    emulate: bool = False
    """Emulate MXFP8 in plain PyTorch ops (for machines without SM100; testing only)."""

    def check(self, path: str) -> None:
        refuse_upstream_only(
            self,
            path,
            use_fp8_dim1_cast_triton_kernel="choice of MX cast kernel",
            mxfp8_dim1_cast_kernel_choice="choice of MX cast kernel",
        )


@dataclass
class LinearQuantizeConfig:
    float8: Float8LinearConfig = field(default_factory=Float8LinearConfig)
    """Float8 linears (converter quantize.linear.float8, or float8)."""

    mx: MXLinearConfig = field(default_factory=MXLinearConfig)
    """MX linears (converter quantize.linear.mx, or mx)."""


@dataclass
class Float8GroupedMMConfig:
    fqns: list[str] = field(default_factory=list)
    """MoE expert modules whose FQN contains one of these strings run their grouped GEMMs in
    float8 rowwise (comma-separated), e.g. experts. Needs CUDA SM90+."""


@dataclass
class MXGroupedMMConfig:
    recipe_name: Literal["mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8", "mxfp8_cublas"] = (
        "mxfp8_rceil"
    )
    """MXFP8 recipe of the expert grouped GEMMs. Needs CUDA SM100. Upstream's names for
    older torchao (mxfp8, mxfp8_cublas) load but are refused when MX is enabled."""

    fqns: list[str] = field(default_factory=list)
    """MoE expert modules whose FQN contains one of these strings run in MXFP8 (comma-separated)."""


@dataclass
class GroupedMMQuantizeConfig:
    float8: Float8GroupedMMConfig = field(default_factory=Float8GroupedMMConfig)
    """Float8 expert grouped GEMMs (converter quantize.grouped_mm.float8)."""

    mx: MXGroupedMMConfig = field(default_factory=MXGroupedMMConfig)
    """MXFP8 expert grouped GEMMs (converter quantize.grouped_mm.mx)."""


@dataclass
class QuantizeConfig:
    linear: LinearQuantizeConfig = field(default_factory=LinearQuantizeConfig)
    """Low-precision nn.Linear training (torchao), read by the converters in model.converters."""

    grouped_mm: GroupedMMQuantizeConfig = field(default_factory=GroupedMMQuantizeConfig)
    """Low-precision MoE grouped GEMMs (torchao), read by the converters in model.converters."""

    def check(self, path: str) -> None:
        self.linear.float8.check(f"{path}.linear.float8")
        self.linear.mx.check(f"{path}.linear.mx")


@dataclass
class LoRAConfig:
    """Low-rank adapters (converter ``lora``): the base model is frozen, only adapters train."""

    rank: int = 8
    """Rank r of each adapter (lora_a is [r, in], lora_b is [out, r])."""

    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank (PEFT's lora_alpha)."""

    dropout: float = 0.0
    """Dropout on the adapter's input during training (PEFT's lora_dropout)."""

    target_modules: list[str] = field(default_factory=lambda: ["attention"])
    """Linears that get adapters (comma-separated): presets attention (q/k/v/o), mlp (the
    dense feed-forward) and output, or FQN globs (layers.*.attention.wq) or last names (wq)."""

    base_quantization: Literal["none", "nf4"] = "none"
    """QLoRA: "nf4" stores the frozen base weight of every adapted linear as a torchao NF4
    tensor (about 0.52 bytes per value), dequantized inside each matmul; FSDP/HSDP, PP and CP
    compose with it, tensor parallel and the float8/mx converters do not."""

    save_adapters_only: bool = True
    """Checkpoints hold the adapters, their optimizer state and the run state, not the
    frozen base, which loads from checkpoint.initial_load_path at every start."""

    peft_adapter_path: str | None = None
    """A Hugging Face PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) to
    start the adapters from (a checkpoint of this run wins). With checkpoint.last_save_in_hf
    the run also writes its adapters as a PEFT folder, step-N-peft."""

    def check(self, path: str) -> None:
        check_values(self, path, rank=AT_LEAST_1, alpha=POSITIVE, dropout=IN_0_1_OPEN)


@dataclass
class DPOConfig:
    """Direct preference optimisation on preference pairs (``training.dataset =
    "preference"``): the loss compares the policy's log-probabilities of each pair's chosen
    and rejected completions with a frozen reference's (the starting weights; under LoRA the
    base with the adapters off, no second copy). Names and formulas follow TRL's DPOConfig."""

    enable: bool = False
    """Train with the DPO loss instead of cross-entropy."""

    beta: float = 0.1
    """How far the policy may move from the reference (the DPO temperature)."""

    loss_type: Literal["sigmoid", "robust", "ipo"] = "sigmoid"
    """sigmoid: the DPO loss; robust: rDPO, robust to a rate ``label_smoothing`` of flipped
    preferences; ipo: IPO's squared loss on per-token log-ratios."""

    label_smoothing: float = 0.0
    """The assumed rate of flipped preference labels (loss_type robust only), in [0, 0.5)."""

    def check(self, path: str) -> None:
        check_values(self, path, beta=POSITIVE)
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"{path}.label_smoothing: must be in [0, 0.5), got {self.label_smoothing!r}"
            )
        if self.label_smoothing and self.loss_type != "robust":
            raise ConfigError(
                f"{path}.label_smoothing: applies to loss_type 'robust' (rDPO), not "
                f"{self.loss_type!r}; set it to 0 or use loss_type robust"
            )


@dataclass
class GRPOConfig:
    """Reinforcement learning with verifiable rewards (``training.dataset = "prompts"``): each
    step samples ``num_generations`` completions of every prompt from the policy being
    trained, scores them with the reward functions, and takes a clipped policy-gradient step
    on the group-relative advantages. Names, defaults and formulas follow TRL's GRPOConfig
    (``training.global_batch_size`` counts completions, as TRL's batch does)."""

    enable: bool = False
    """Train with GRPO on prompts instead of cross-entropy on text."""

    num_generations: int = 8
    """Completions sampled per prompt (the group); at least 2."""

    max_completion_length: int = 64
    """Tokens generated per completion at most (a completion also ends at EOS)."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts (0: greedy); the policy's log-probabilities are
    taken at it too."""

    top_p: float = 1.0
    """Nucleus sampling of the rollouts: the smallest set of tokens reaching this probability."""

    top_k: int | None = None
    """Sample among the k most likely tokens only; unset = all."""

    reward_funcs: list[str] = field(default_factory=lambda: ["exact_match"])
    """Registered reward functions (comma-separated); built in: exact_match, format."""

    reward_weights: list[float] | None = None
    """One weight per reward function (the reward is their weighted sum); unset = all 1."""

    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide each advantage by the std of its group's rewards, of the batch's, or not at all."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """grpo: mean per completion, then over completions; bnpo and dapo: mean over all
    completion tokens of the global batch (DAPO's token-level normalisation); dr_grpo: sum over
    tokens / (completions x max_completion_length)."""

    beta: float = 0.0
    """Weight of the KL term to the reference (the starting weights; 0: no reference)."""

    epsilon: float = 0.2
    """Lower clip of the probability ratio: 1 - epsilon."""

    epsilon_high: float | None = None
    """Upper clip, 1 + epsilon_high (DAPO's asymmetric clipping uses 0.28); unset = epsilon."""

    use_bias_correction_kl: bool = True
    """Multiply the KL term by the probability ratio (TRL's default; DeepSeek-V3.2)."""

    drop_uniform_groups: bool = False
    """DAPO's dynamic sampling: leave out of the loss the groups whose rewards are all equal
    (their advantages are 0; they would only dilute the mean)."""

    def check(self, path: str) -> None:
        if self.num_generations < 2:
            raise ConfigError(
                f"{path}.num_generations: a group needs at least 2 completions to compare, "
                f"got {self.num_generations}"
            )
        check_values(
            self,
            path,
            max_completion_length=AT_LEAST_1,
            temperature=AT_LEAST_0,
            top_p=Rule(lambda v: 0 < v <= 1, "must be in (0, 1]"),
            top_k=unset_or(AT_LEAST_1),
            beta=AT_LEAST_0,
            epsilon=IN_0_1_OPEN,
            epsilon_high=unset_or(POSITIVE),
        )
        if not self.reward_funcs:
            raise ConfigError(f"{path}.reward_funcs: name at least one reward function")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(
                f"{path}.reward_weights: {len(self.reward_weights)} weights for "
                f"{len(self.reward_funcs)} reward functions; give one per function"
            )


@dataclass
class CommConfig:
    init_timeout_seconds: int = 300
    """Collective timeout during initialisation and the first step."""

    train_timeout_seconds: int = 100
    """Collective timeout after the first step."""

    trace_buf_size: int = 20000
    """Flight-recorder entries: torch's record of recent collectives, dumped by NCCL on a
    timeout and by the hang watchdog (NCCL, and gloo on torch >= 2.7; 0 disables)."""

    save_traces_folder: str = "comm_traces"
    """Flight-recorder dump folder, relative to job.dump_folder."""

    save_traces_file_prefix: str = "rank_"
    """Flight-recorder dump file name prefix (the rank is appended)."""

    hang_timeout_factor: float = 10.0
    """A training step that has run this many times the median step (and at least
    hang_timeout_floor_seconds) is a hang: every rank writes its threads' stacks to
    job.dump_folder/hangs/step-N/rank-R.txt and rank 0 names the ranks that are not in the
    collective the others wait in (0 turns the watchdog off)."""

    hang_timeout_floor_seconds: float = 60.0
    """The shortest step the watchdog reports as a hang."""

    on_hang: Literal["wait", "exit"] = "wait"
    """After a hang is reported: wait (comm.train_timeout_seconds still ends the job), or
    exit with status 124 on every rank, so that automatic restart (MAX_RESTARTS) resumes
    from the last checkpoint."""

    mode: Literal["default", "fake_backend", "local_tensor"] = "default"
    """Upstream's dry-run modes are not supported here (use python -m torchtitan.preflight
    --world-size N); only the default is accepted."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            hang_timeout_factor=Rule(
                lambda v: v == 0 or v > 1,
                "must be 0 (no hang watchdog) or above 1 (times the median step)",
            ),
            hang_timeout_floor_seconds=POSITIVE,
            init_timeout_seconds=AT_LEAST_1,
            train_timeout_seconds=AT_LEAST_1,
        )
        refuse_upstream_only(
            self,
            path,
            mode=(
                "fake-backend dry runs (python -m torchtitan.preflight --world-size N checks a "
                "layout)"
            ),
        )


@dataclass
class MemoryEstimationConfig:
    enable: bool = False
    """Estimate memory instead of training."""

    disable_fake_mode: bool = False
    """Trace on real tensors (one process, fake process group) instead of fake ones."""

    world_size: int | None = None
    """World size to estimate for (default: NGPU x NNODES)."""

    device_memory_gib: float | None = None
    """Memory per device in GiB: the estimate says whether it fits; required by mode plan."""

    target_device: Literal["cuda", "cpu"] = "cuda"
    """Device whose kernels and allocator the estimate emulates (cpu: what a CPU run allocates)."""

    mode: Literal["estimate", "analytic", "plan", "measure", "validate"] = "estimate"
    """estimate one layout (traced), estimate it in closed form (fast, for large models),
    plan layouts, or measure a real run beside the estimate ("validate" is its older name)."""

    reserved_margin: float = 0.15
    """CUDA caching-allocator reserve over the allocated peak (fragmentation), as a fraction;
    12-35 % was measured on an H200 for Llama 3 8B."""

    nccl_allowance_gib: float = 1.0
    """Per-rank allowance for NCCL communicator buffers (not traced; depends on the cluster)."""

    gpus_per_node: int = 8
    """For mode plan: GPUs per node (tensor and context parallel stay inside a node)."""

    plan_traced_layouts: int = 2
    """For mode plan: how many of the best layouts the trainer supports to trace (0: none)."""

    plot: str | None = None
    """PNG path: the traced peak's per-phase memory breakdown as a stacked bar (needs
    matplotlib: the plot extra)."""

    time: bool = False
    """Also predict the step time (tokens/s per GPU, MFU, per-phase breakdown) on ``gpu``
    GPUs; ``--time`` on the estimation script's command line."""

    gpu: Literal["H100", "H200", "B200", "A100"] = "H100"
    """GPU kind whose data-sheet peaks and NVLink bandwidth the step-time model (``time``
    and mode plan's ranking) uses."""

    network_gbps_per_gpu: float = 400.0
    """Bandwidth between nodes per GPU in Gb/s (one 400 Gb/s NIC per GPU), for the
    step-time model."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            world_size=unset_or(AT_LEAST_1),
            device_memory_gib=unset_or(POSITIVE),
            reserved_margin=AT_LEAST_0,
            nccl_allowance_gib=AT_LEAST_0,
            gpus_per_node=AT_LEAST_1,
            plan_traced_layouts=AT_LEAST_0,
            network_gbps_per_gpu=POSITIVE,
        )
        refuse_until_supported(
            self,
            path,
            enable="memory estimation inside the trainer (use scripts/estimate/estimation.py)",
        )
        if self.plot is not None and self.mode != "estimate":
            raise ConfigError(
                "memory_estimation.plot: only mode estimate draws it (from its trace), not mode "
                f"{self.mode!r}"
            )
        if self.plot is not None and self.disable_fake_mode:
            raise ConfigError(
                "memory_estimation.plot: drawn from the trace on fake tensors; not with "
                "memory_estimation.disable_fake_mode"
            )


_SEMI_SYNC_METHODS = (None, "diloco", "local_sgd")

# Settings only DiLoCo reads, at the values that leave them off.
_DILOCO_ONLY = {"should_quantize": False, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}


@dataclass
class FaultToleranceConfig:
    """Replica-group fault tolerance on torchft: each replica group is its own torchrun job
    (its own FSDP/TP/... layout) and the groups form the fault-tolerant replicate dimension.
    The lighthouse's address comes from the environment variable TORCHFT_LIGHTHOUSE."""

    enable: bool = False
    """Fault-tolerant training with torchft."""

    process_group: Literal["gloo", "nccl"] = "gloo"
    """Backend of the process group between replica groups."""

    process_group_timeout_ms: int = 10000
    """Timeout of that process group: how long a collective waits for a lost peer."""

    replica_id: int = 0
    """This replica group's id, 0 .. group_size - 1."""

    heal_address: str = ""
    """Address (host name or IP of this host) the live-healing server listens on and peers
    fetch a rejoining group's state from; empty: this host's name."""

    group_size: int = 0
    """Number of replica groups the data is split over."""

    min_replica_size: int = 1
    """Replica groups needed to commit a step (or an outer sync)."""

    semi_sync_method: str | None = None
    """None: fault-tolerant HSDP (gradients averaged over the live groups every step);
    "diloco" or "local_sgd": groups train alone and synchronise every sync_steps steps."""

    sync_steps: int = 5
    """Steps between semi-sync synchronisations."""

    should_quantize: bool = False
    """Quantize the semi-sync outer-optimizer communication (needs CUDA and triton)."""

    fragment_sync_delay: int = 0
    """Steps a model fragment's synchronisation is delayed (streaming DiLoCo)."""

    fragment_update_alpha: float = 0.0
    """Mixing weight of the local and global fragment parameters (streaming DiLoCo)."""

    def check(self, path: str) -> None:
        if not self.enable:
            return
        check_values(
            self,
            path,
            group_size=Rule(lambda v: v >= 1, "must be >= 1 with fault_tolerance.enable"),
        )
        if not 0 <= self.replica_id < self.group_size:
            raise ConfigError(
                "fault_tolerance.replica_id: must be in 0 .. group_size - 1 = "
                f"{self.group_size - 1}, got {self.replica_id}"
            )
        if not 1 <= self.min_replica_size <= self.group_size:
            raise ConfigError(
                "fault_tolerance.min_replica_size: must be in 1 .. group_size = "
                f"{self.group_size}, got {self.min_replica_size}"
            )
        if self.semi_sync_method not in _SEMI_SYNC_METHODS:
            raise ConfigError(
                "fault_tolerance.semi_sync_method: must be unset, 'diloco' or 'local_sgd', "
                f"got {self.semi_sync_method!r}"
            )
        check_values(self, path, process_group_timeout_ms=AT_LEAST_1)
        if self.semi_sync_method is not None:
            self._check_semi_sync(path)

    def _check_semi_sync(self, path: str) -> None:
        check_values(self, path, sync_steps=AT_LEAST_1)
        if self.semi_sync_method == "local_sgd":
            self._refuse_diloco_only_settings(path)
        if not 0 <= self.fragment_sync_delay < self.sync_steps:
            raise ConfigError(
                "fault_tolerance.fragment_sync_delay: must be in 0 .. sync_steps - 1, "
                f"got {self.fragment_sync_delay}"
            )
        check_values(self, path, fragment_update_alpha=IN_0_1)

    def _refuse_diloco_only_settings(self, path: str) -> None:
        """LocalSGD averages the weights, with no outer optimizer or fragments."""
        for name, off in _DILOCO_ONLY.items():
            if getattr(self, name) != off:
                raise ConfigError(
                    f"fault_tolerance.{name}: only DiLoCo reads it, not semi_sync_method="
                    f"'local_sgd'; leave it at {off} or use semi_sync_method='diloco'"
                )


@dataclass
class ExperimentalConfig:
    custom_import: str = ""
    """Module imported at start, e.g. to register a train spec."""


@dataclass
class ValidationConfig:
    enable: bool = False
    """Evaluate on the validation split every `freq` steps."""

    dataset: str = "python_stdlib_validation"
    """Validation dataset."""

    dataset_path: str | None = None
    """Local path for file datasets (or the hub id of an hf dataset)."""

    hf: HFDatasetConfig = field(default_factory=lambda: HFDatasetConfig(split="validation"))
    """With dataset = "hf": configuration name, split, column, streaming."""

    local_batch_size: int = 8
    """Sequences per rank per validation batch (under pipeline parallel: equal to
    training.local_batch_size, the schedule's batch)."""

    seq_len: int = 2048
    """Tokens per validation sequence (under pipeline parallel: equal to training.seq_len)."""

    freq: int = 500
    """Validate every this many steps."""

    steps: int = -1
    """Validation batches per pass; -1 = the whole split."""

    data_shards: int = 8
    """Data shards of the validation split (the data-parallel degree must divide it). The
    split ends where its shortest shard ends, so fewer shards keep more of it."""

    dataset_mixture: list[DataSourceConfig] = field(default_factory=list)
    """With dataset = "mixture": sources validated one by one (a loss per source, and their
    token-weighted mean); weights and max_epochs are not used here."""

    mixture: str | None = None
    """A mixture on the command line (the syntax of training.mixture): replaces
    dataset_mixture and sets dataset = "mixture"."""

    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    """Data loader keyword arguments of the validation loader."""

    def check(self, path: str) -> None:
        check_values(
            self,
            path,
            local_batch_size=AT_LEAST_1,
            seq_len=AT_LEAST_1,
            freq=AT_LEAST_1,
            data_shards=AT_LEAST_1,
            steps=Rule(lambda v: v == -1 or v >= 1, "must be -1 (whole split) or >= 1"),
        )
        self.dataloader.check(f"{path}.dataloader")
        self.hf.check(f"{path}.hf")
        if self.dataloader.num_workers:
            raise ConfigError(
                "validation.dataloader.num_workers: the finite validation loader reads in the "
                "training process; leave it at 0"
            )
        _apply_mixture_flag(self, path)
        _check_mixture(self.dataset, self.dataset_mixture, path)


@dataclass
class DebugConfig:
    seed: int | None = None
    """Seed for weights and RNG; unset = a random seed shared by all ranks."""

    deterministic: bool = False
    """Use deterministic algorithms (slower)."""

    deterministic_warn_only: bool = False
    """With deterministic: warn instead of failing on an op that has no deterministic
    implementation."""

    moe_force_load_balance: bool = False
    """Route MoE tokens round-robin (tests: no routing flips on rounding ties)."""

    stop_after_step: int | None = None
    """Behave as if preempted after this step: save a full checkpoint and exit 0 (tests of
    exact resume)."""

    fail_at_step: int | None = None
    """Raise an error at the start of this step (tests of automatic restart)."""

    fail_on_rank: int = 0
    """The global rank that raises at debug.fail_at_step."""

    fail_every_attempt: bool = False
    """Raise at debug.fail_at_step in every attempt, not only in the first (restarted
    attempts resume past it otherwise): a crash loop."""

    step_sleep_seconds: float = 0.0
    """Sleep this long at the start of every step: a slow replica group (fault-tolerance
    tests keep a survivor running while a lost peer restarts)."""

    hang_at_step: int | None = None
    """Plant a hang: debug.hang_on_rank sleeps debug.hang_seconds in this step, before the
    step's flag all-reduce that the other ranks wait in (tests of the hang watchdog)."""

    hang_on_rank: int = 1
    """The global rank that sleeps at debug.hang_at_step."""

    hang_seconds: float = 600.0
    """How long the planted hang sleeps."""

    straggler_rank: int | None = None
    """Plant a straggler: this global rank waits debug.straggler_slowdown x its median step
    in its data phase of every step from debug.straggler_from_step."""

    straggler_slowdown: float = 0.3
    """The planted straggler's extra time per step, as a share of its step before."""

    straggler_from_step: int = 5
    """The first step the planted straggler is slow in."""

    def check(self, path: str) -> None:
        never = "must be >= 1 (unset = never)"
        check_values(
            self,
            path,
            fail_at_step=unset_or(AT_LEAST_1, never),
            step_sleep_seconds=AT_LEAST_0,
            hang_at_step=unset_or(AT_LEAST_1, never),
            hang_seconds=POSITIVE,
            straggler_slowdown=POSITIVE,
            straggler_from_step=Rule(lambda v: v >= 2, "must be >= 2 (step 1 warms up)"),
        )


@dataclass
class JobConfig:
    job: JobSectionConfig = field(default_factory=JobSectionConfig)
    """Job-level settings."""
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    """Profiler settings."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logging of metrics."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and tokenizer."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    """Learning-rate schedule."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Training loop and data."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """Parallel degrees and their options."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    """Activation checkpointing."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """torch.compile."""
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    """Low-precision training."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapter fine-tuning (with model.converters = ["lora"])."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Direct preference optimisation (preference pairs, a frozen reference)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO with verifiable rewards (rollouts from the policy being trained)."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Communication timeouts and tracing."""
    memory_estimation: MemoryEstimationConfig = field(default_factory=MemoryEstimationConfig)
    """Memory estimation and layout planning."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Fault tolerance (TorchFT)."""
    experimental: ExperimentalConfig = field(default_factory=ExperimentalConfig)
    """Experimental extensions."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Validation during training."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Seeds, determinism and test-only switches."""
