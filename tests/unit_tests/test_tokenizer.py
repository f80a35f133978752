import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from torchtitan.config import ModelConfig
from torchtitan.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEXT = "def f(x):\n    return x + 1  # héllo ✓\n"


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_tokenizer_script = _load_script("train_tokenizer")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    return train_tokenizer_script.train_tokenizer(out, vocab_size=384, max_docs=60)


def _job(tokenizer_path=None, hf_assets_path=None) -> ModelConfig:
    return ModelConfig(tokenizer_path=tokenizer_path, hf_assets_path=hf_assets_path)


def _with_bos_post_processor(bpe_dir: Path, out: Path, with_config: bool) -> Path:
    tokenizer = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    bos = train_tokenizer_script.BOS
    tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    out.mkdir()
    tokenizer.save(str(out / "tokenizer.json"))
    if with_config:
        (out / "tokenizer_config.json").write_text((bpe_dir / "tokenizer_config.json").read_text())
    return out


# ---- byte tokenizer


def test_byte_round_trip_and_flags():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id == 256 and ids[-1] == tok.eos_id == 257
    assert ids[1:-1] == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.encode(TEXT, add_bos=False, add_eos=False) == list(TEXT.encode("utf-8"))
    assert tok.encode(TEXT, add_bos=False)[-1] == 257 and tok.encode(TEXT, add_eos=False)[0] == 256
    assert tok.encode("", add_bos=False, add_eos=False) == []


def test_byte_vocab_and_special_ids():
    tok = ByteTokenizer()
    assert tok.vocab_size == 264 and tok.vocab_size % 8 == 0
    assert tok.pad_id == 258
    assert tok.decode([104, 258, 105, 259, 263]) == "hi"
    assert tok.decode([0xFF, 104]) == "\ufffdh"


# ---- HuggingFace tokenizer trained on the fly


def test_hf_round_trip(bpe_dir):
    tok = HuggingFaceTokenizer(bpe_dir)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode("utf-8"))  # merges learned something
    assert tok.vocab_size == 384
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_hf_special_ids_from_tokenizer_config(bpe_dir):
    tok = HuggingFaceTokenizer(bpe_dir)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    ids = tok.encode(TEXT)
    assert ids[0] == 0 and ids[-1] == 1 and ids.count(0) == 1
    assert tok.encode(TEXT, add_bos=False, add_eos=False) == ids[1:-1]


def test_hf_special_tokens_as_dicts(bpe_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    config = {
        "bos_token": {"content": "<|end_of_text|>", "lstrip": False},
        "eos_token": {"content": "<|pad|>"},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HuggingFaceTokenizer(tmp_path / "tokenizer.json")  # a direct file path works too
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)


@pytest.mark.parametrize("with_config", [True, False])
def test_hf_no_double_bos_with_bos_post_processor(bpe_dir, tmp_path, with_config):
    path = _with_bos_post_processor(bpe_dir, tmp_path / "tok", with_config)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert raw.encode("a").ids[0] == 0  # the post-processor really adds BOS
    tok = HuggingFaceTokenizer(path)
    assert tok.bos_id == 0  # without tokenizer_config it is inferred from the post-processor
    ids = tok.encode(TEXT)
    assert ids[0] == 0 and ids[1] != 0 and ids.count(0) == 1
    assert tok.encode(TEXT, add_bos=False)[0] != 0
    assert tok.decode(ids) == TEXT


def test_hf_config_token_missing_from_tokenizer_json_is_appended(bpe_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    tok = HuggingFaceTokenizer(tmp_path)
    assert tok.bos_id == 384 and tok.vocab_size == 385
    assert tok.encode_rendered("<s>") == [384]


def test_hf_malformed_config_token(bpe_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": 7}))
    with pytest.raises(
        ValueError, match=r"^model.tokenizer_path: eos_token in tokenizer_config.json must be"
    ):
        HuggingFaceTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": {"5": {"special": True}}})
    )
    with pytest.raises(
        ValueError,
        match=r"^model.tokenizer_path: added_tokens_decoder in tokenizer_config.json must",
    ):
        HuggingFaceTokenizer(tmp_path)


def test_hf_missing_paths(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"model.tokenizer_path: .*does not exist.*tokenizer.json"
    ):
        HuggingFaceTokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"model.hf_assets_path: .*has no tokenizer.json"):
        build_tokenizer(_job(hf_assets_path=str(tmp_path)))


def test_build_tokenizer_choice(bpe_dir):
    assert isinstance(build_tokenizer(_job()), ByteTokenizer)
    assert isinstance(
        build_tokenizer(_job(tokenizer_path="byte", hf_assets_path="/nope")), ByteTokenizer
    )
    assert isinstance(build_tokenizer(_job(tokenizer_path=str(bpe_dir))), HuggingFaceTokenizer)
    assert isinstance(build_tokenizer(_job(hf_assets_path=str(bpe_dir))), HuggingFaceTokenizer)
    with pytest.raises(FileNotFoundError, match=r"model\.tokenizer_path"):
        build_tokenizer(_job(tokenizer_path="/nope", hf_assets_path=str(bpe_dir)))


# ---- scripts


def test_train_tokenizer_rejects_tiny_vocab(tmp_path):
    with pytest.raises(ValueError, match=r"--vocab_size must be at least 259"):
        train_tokenizer_script.train_tokenizer(tmp_path, vocab_size=100)


def test_download_hf_assets_offline_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "download_hf_assets.py"),
        "--repo_id",
        "org/model",
    ]
    cmd += ["--assets", "tokenizer", "config", "--local_dir", str(tmp_path / "out")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("error: cannot download")
        and "org/model" in lines[0]
    )


def test_download_hf_assets_patterns():
    download = _load_script("download_hf_assets")
    patterns = download.allow_patterns(["tokenizer", "safetensors"])
    assert (
        "tokenizer.json" in patterns
        and "*.safetensors" in patterns
        and "config.json" not in patterns
    )
    assert download.default_local_dir("meta-llama/Llama-3.1-8B") == "assets/hf/Llama-3.1-8B"


# ---- chat templates


def test_byte_chat_template_and_rendered_specials():
    tok = ByteTokenizer()
    assert tok.special_tokens() == {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    assert tok.encode_rendered("<|bos|>hi<|eos|><|pad|>") == [256, 104, 105, 257, *b"<|pad|>"]
    assert tok.encode("<|bos|>", add_bos=False, add_eos=False) == list(
        b"<|bos|>"
    )  # plain text stays bytes
    assert "messages" in tok.chat_template()


def _copy_tokenizer(bpe_dir: Path, out: Path, config: dict) -> Path:
    out.mkdir()
    (out / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_hf_chat_template_sources(bpe_dir, tmp_path):
    plain = _copy_tokenizer(bpe_dir, tmp_path / "plain", {"chat_template": "{{ messages }}"})
    tok = HuggingFaceTokenizer(plain)
    assert tok.chat_template() == "{{ messages }}"
    assert tok.special_tokens() == {}  # no bos/eos/pad named, none inferred
    (plain / "chat_template.jinja").write_text("from the jinja file")
    assert HuggingFaceTokenizer(plain).chat_template() == "from the jinja file"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]
    named_dir = _copy_tokenizer(bpe_dir, tmp_path / "named", {"chat_template": named})
    assert HuggingFaceTokenizer(named_dir).chat_template() == "chat"
    with pytest.raises(
        ValueError, match=r"model.tokenizer_path: chat_template in tokenizer_config.json must be"
    ):
        HuggingFaceTokenizer(_copy_tokenizer(bpe_dir, tmp_path / "bad", {"chat_template": 3}))


def test_hf_without_chat_template(bpe_dir):
    tok = HuggingFaceTokenizer(bpe_dir)
    specials = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|pad|>",
    }
    assert tok.special_tokens() == specials
    assert tok.encode_rendered("<|begin_of_text|>a") == [
        0,
        *tok.encode("a", add_bos=False, add_eos=False),
    ]
    with pytest.raises(
        ValueError, match=r"^model.tokenizer_path: the tokenizer in .* has no chat template"
    ):
        tok.chat_template()


# ---- tokenizer folders as shipped, checked against transformers' AutoTokenizer


def _special(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
        "special": True,
    }


def _byte_level_bpe(added: list[str]) -> Tokenizer:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([TEXT * 20, "hello world, the quick brown fox " * 20], trainer)
    tokenizer.add_special_tokens(added)
    return tokenizer


def _upstream_test_shaped(out: Path) -> None:
    """Like upstream torchtitan's test tokenizer: BOS/EOS exist only in tokenizer_config.json."""
    _byte_level_bpe([]).save(str(out / "tokenizer.json"))
    config = {
        "added_tokens_decoder": {
            "128000": _special("<|begin_of_text|>"),
            "128001": _special("<|end_of_text|>"),
        },
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def _llama3_shaped(out: Path) -> None:
    """Specials in tokenizer.json's added_tokens, a post-processor that adds BOS, names in the
    config."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokenizer = _byte_level_bpe(specials)
    bos_id = tokenizer.token_to_id(specials[0])
    tokenizer.post_processor = TemplateProcessing(
        single=f"{specials[0]} $A",
        pair=f"{specials[0]} $A $B",
        special_tokens=[(specials[0], bos_id)],
    )
    tokenizer.save(str(out / "tokenizer.json"))
    decoder = {str(tokenizer.token_to_id(s)): _special(s) for s in specials}
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": specials[0],
        "eos_token": specials[2],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def _chat_shaped(out: Path) -> None:
    """Qwen-like: chat specials and the pad token only in the config, a chat_template, no BOS."""
    _byte_level_bpe(["<|endoftext|>"]).save(str(out / "tokenizer.json"))
    decoder = {
        "151644": _special("<|im_start|>"),
        "151645": _special("<|im_end|>"),
        "151646": {**_special("<tool>"), "special": False},
    }
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "chat_template": (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        ),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))


SHIPPED_TEXT = (
    "<|begin_of_text|>hello world<|eot_id|> <|im_start|>user\nthe fox<tool><|im_end|><|pad|> é✓"
)


@pytest.mark.parametrize("shape", [_upstream_test_shaped, _llama3_shaped, _chat_shaped])
def test_hf_folder_matches_transformers(tmp_path, shape):
    from transformers import AutoTokenizer

    shape(tmp_path)
    ours, theirs = HuggingFaceTokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert ours.vocab_size == len(theirs)
    ids = ours.encode(SHIPPED_TEXT, add_bos=False, add_eos=False)
    assert ids == theirs(SHIPPED_TEXT, add_special_tokens=False).input_ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode_rendered(SHIPPED_TEXT) == ids


def test_hf_shipped_folders_specifics(tmp_path):
    from transformers import AutoTokenizer

    for shape in (_upstream_test_shaped, _llama3_shaped, _chat_shaped):
        (tmp_path / shape.__name__).mkdir()
        shape(tmp_path / shape.__name__)
    upstream = tmp_path / "_upstream_test_shaped"
    base_vocab = Tokenizer.from_file(str(upstream / "tokenizer.json")).get_vocab_size()
    tok = HuggingFaceTokenizer(upstream)
    assert (tok.bos_id, tok.eos_id) == (
        base_vocab,
        base_vocab + 1,
    )  # appended, not the config's 128000/128001
    llama = tmp_path / "_llama3_shaped"
    assert (
        HuggingFaceTokenizer(llama).encode("the fox", add_eos=False)
        == AutoTokenizer.from_pretrained(str(llama))("the fox").input_ids
    )  # BOS once, as the post-processor adds it
    chat = tmp_path / "_chat_shaped"
    assert (
        HuggingFaceTokenizer(chat).chat_template()
        == AutoTokenizer.from_pretrained(str(chat)).chat_template
    )
    assert HuggingFaceTokenizer(chat).special_tokens() == {
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
    }
