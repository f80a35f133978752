"""Generation: the KV cache reproduces the training forward, sampling is seeded, DCP
checkpoints load in both layouts, and the command line refuses a bad checkpoint in one line
(generating from a trained checkpoint: tests/integration_tests/test_generation_cli.py)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.launcher import REPO_ROOT
from torchtitan.generation import CheckpointError, generate, kv_cache, load_model_weights
from torchtitan.generation.generate import filtered_logits
from torchtitan.layers.attention import ScaledDotProductAttention
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SCRIPT = REPO_ROOT / "scripts" / "generate" / "test_generate.py"
DEBUG_TOML = REPO_ROOT / "train_configs" / "debug_model.toml"
TINY = "debugmodel_tiny"


def build(seed: int = 0, max_seq_len: int = 128) -> Transformer:
    args = dataclasses.replace(llama3_flavors[TINY], max_seq_len=max_seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=seed)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> Transformer:
    return build()


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_kv_cache_logits_equal_the_training_forward(model, prompt) -> None:
    full = model(prompt)
    with kv_cache(model, max_len=prompt.shape[1]) as caches:
        pieces = [model(prompt[:, :5], positions=torch.arange(5))]
        pieces += [
            model(prompt[:, p : p + 1], positions=torch.arange(p, p + 1)) for p in range(5, 9)
        ]
        assert all(cache.length == 9 for cache in caches)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert all(
        isinstance(layer.attention.inner_attention, ScaledDotProductAttention)
        for layer in model.layers.values()
    ), "the original attention must be restored"


@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, None), (0.8, 20)])
@pytest.mark.parametrize("multiple", [1, 4])
def test_kv_cache_gives_the_no_cache_tokens(model, prompt, temperature, top_k, multiple) -> None:
    """Without the cache, also with the sequence right-padded to a multiple of 4 (as sequence
    parallel needs under TP)."""
    kwargs = dict(max_new_tokens=24, temperature=temperature, top_k=top_k, seed=5)
    cached = generate(model, prompt, use_kv_cache=True, **kwargs)
    uncached = generate(model, prompt, use_kv_cache=False, length_multiple=multiple, **kwargs)
    assert cached.shape == (2, 9 + 24)
    assert torch.equal(cached, uncached)


def test_a_fixed_seed_gives_the_same_tokens(model, prompt) -> None:
    runs = [generate(model, prompt, max_new_tokens=24, seed=seed) for seed in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0][0], runs[0][1]), "rows of a batch sample independently"


def test_top_k_1_is_greedy(model, prompt) -> None:
    greedy = generate(model, prompt, max_new_tokens=12, temperature=0.0)
    assert torch.equal(
        generate(model, prompt, max_new_tokens=12, temperature=1.0, top_k=1, seed=3), greedy
    )


def test_generation_stops_once_every_row_ended(model, prompt) -> None:
    first = generate(model, prompt, max_new_tokens=1, temperature=0.0)[:, -1]
    out = generate(model, prompt, max_new_tokens=10, temperature=0.0, stop_ids=(int(first[0]),))
    if first[1] == first[0]:
        assert out.shape[1] == prompt.shape[1] + 1
    assert (out[0, prompt.shape[1] :] == first[0]).all(), "a finished row is padded with EOS"


@pytest.mark.parametrize("top_k, top_p", [(None, 0.9), (50, 0.5), (5, 1.0), (None, 0.01)])
def test_sampling_filters_equal_transformers_logits_warpers(top_k, top_p) -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    theirs = TemperatureLogitsWarper(0.7)(None, logits.clone())
    if top_k is not None:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    ours = filtered_logits(logits, 0.7, top_k, top_p)
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


def test_each_row_stops_at_any_stop_token_and_repeats_it(model, prompt) -> None:
    """Rows stop at whichever stop id they produce first; a row that never does runs on."""
    free = generate(model, prompt, max_new_tokens=10, temperature=0.0)[:, prompt.shape[1] :]
    stops = (int(free[0, 2]), int(free[1, 4]))
    out = generate(model, prompt, max_new_tokens=10, temperature=0.0, stop_ids=stops)
    for row, new in zip(free, out[:, prompt.shape[1] :]):
        hits = [k for k, t in enumerate(row.tolist()) if t in stops]
        end = hits[0] + 1 if hits else len(row)
        assert torch.equal(new[:end], row[:end])
        assert (new[end:] == row[end - 1]).all()


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_loads_both_checkpoint_layouts(layout, tmp_path) -> None:
    source = build(seed=7)
    state = source.state_dict()
    dcp.save({"model": state} if layout == "nested" else state, checkpoint_id=str(tmp_path))
    target = build(seed=0)
    assert load_model_weights(target, tmp_path) == tmp_path
    for key, value in target.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_a_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    dcp.save(
        {"model": {"tok_embeddings.weight": torch.zeros(3, 3)}}, checkpoint_id=str(tmp_path / "a")
    )
    with pytest.raises(CheckpointError, match="--checkpoint: .* entries to load are missing"):
        load_model_weights(build(), tmp_path / "a")
    dcp.save(
        build(max_seq_len=8).state_dict() | {"output.weight": torch.zeros(5, 64)},
        checkpoint_id=str(tmp_path / "b"),
    )
    with pytest.raises(CheckpointError, match="'output.weight' has shape \\(5, 64\\)"):
        load_model_weights(build(), tmp_path / "b")


def test_a_root_without_complete_checkpoints_is_refused(tmp_path) -> None:
    dcp.save(build().state_dict(), checkpoint_id=str(tmp_path / "step-5.tmp"))
    (tmp_path / "step-4").mkdir()  # no checkpoint.json: an unfinished save
    with pytest.raises(CheckpointError, match="no complete step-<N>"):
        load_model_weights(build(), tmp_path)


def load_cli():
    """scripts/generate/test_generate.py as a module, to call its main() in this process."""
    spec = importlib.util.spec_from_file_location("test_generate_cli", SCRIPT)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_command_line_refuses_a_missing_checkpoint_in_one_line(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_cli().main(["--config", str(DEBUG_TOML), "--checkpoint", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: --checkpoint:")


def test_sliding_window_flex_model_generates_the_same_with_and_without_cache(prompt) -> None:
    """A prompt is one document; the KV cache applies the model's window."""
    args = dataclasses.replace(
        llama3_flavors[TINY], max_seq_len=64, attn_type="flex", sliding_window=4
    )
    flex_model = Transformer(args)
    with torch.no_grad():
        flex_model.init_weights(seed=0)
    kwargs = dict(max_new_tokens=12, temperature=0.0)
    cached = generate(flex_model.eval(), prompt, use_kv_cache=True, **kwargs)
    assert torch.equal(cached, generate(flex_model, prompt, use_kv_cache=False, **kwargs))
    with torch.no_grad():  # the window matters from position 4 on
        windowed, causal = flex_model(cached), build(max_seq_len=64)(cached)
    torch.testing.assert_close(windowed[:, :4], causal[:, :4], rtol=1e-5, atol=1e-5)
    assert (windowed[:, 4:] - causal[:, 4:]).abs().max() > 1e-3
