"""Builds a JobConfig from defaults < TOML file < CLI flags (parsed by tyro).

Unknown TOML sections/keys are errors with a suggestion (upstream silently ignores them),
older key names are accepted as deprecated aliases, and every bad input becomes one
``ConfigError`` line naming the field.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import importlib
import io
import json
import logging
import os
import re
import sys
import types
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import tyro

from torchtitan.config.checks import check_job_config, get_field
from torchtitan.config.errors import ConfigError
from torchtitan.config.hub import resolve_hf_assets_path
from torchtitan.config.job_config import JobConfig
from torchtitan.config.toml_chain import load_toml_chain

logger = logging.getLogger("torchtitan")


# Older (section, key) names still accepted, mapped to the current ones.
DEPRECATED_ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    ("checkpoint", "enable_checkpoint"): ("checkpoint", "enable"),
    ("checkpoint", "last_save_model_weights_only"): ("checkpoint", "last_save_model_only"),
    ("checkpoint", "initial_load_model_weights_only"): ("checkpoint", "initial_load_model_only"),
    ("training", "compile"): ("compile", "enable"),
    ("training", "seed"): ("debug", "seed"),
    ("training", "deterministic"): ("debug", "deterministic"),
    ("training", "batch_size"): ("training", "local_batch_size"),
    ("training", "data_parallel_replicate_degree"): (
        "parallelism",
        "data_parallel_replicate_degree",
    ),
    ("training", "data_parallel_shard_degree"): ("parallelism", "data_parallel_shard_degree"),
    ("training", "tensor_parallel_degree"): ("parallelism", "tensor_parallel_degree"),
    ("validation", "enabled"): ("validation", "enable"),
    ("lr_scheduler", "lr_min"): ("lr_scheduler", "min_lr_factor"),
    ("experimental", "custom_args_module"): ("job", "custom_config_module"),
    ("memory_estimation", "enabled"): ("memory_estimation", "enable"),
    ("job", "print_args"): ("job", "print_config"),
}


# Older section names whose keys moved unchanged to a new (nested) section.
DEPRECATED_SECTION_ALIASES: dict[str, str] = {
    "float8": "quantize.linear.float8",
    "mx": "quantize.linear.mx",
    "quantize.float8": "quantize.linear.float8",
}


# Older values of a field, mapped to the current ones (field path, old value) -> new value.
DEPRECATED_VALUES: dict[tuple[str, str], str] = {
    ("memory_estimation.mode", "validate"): "measure",
}


def _apply_value_aliases(config: Any) -> None:
    for (path, old), new in DEPRECATED_VALUES.items():
        section, _, name = path.rpartition(".")
        holder = get_field(config, section)
        if getattr(holder, name) == old:
            logger.warning(f"config: {path} = {old!r} is deprecated; use {new!r}")
            setattr(holder, name, new)


def _warn_deprecated(old: tuple[str, str], new: tuple[str, str]) -> None:
    logger.warning(f"config: '{'.'.join(old)}' is deprecated; use '{'.'.join(new)}'")


# ---------------------------------------------------------------------------- TOML side


def _move_section_aliases(data: dict[str, Any]) -> None:
    for old, new in DEPRECATED_SECTION_ALIASES.items():
        *old_parents, old_name = old.split(".")
        parent = data
        for name in old_parents:
            parent = parent.get(name) if isinstance(parent.get(name), dict) else {}
        if not isinstance(parent.get(old_name), dict):
            continue
        _warn_deprecated((old, "*"), (new, "*"))
        target = data
        for name in new.split("."):
            target = target.setdefault(name, {})
        for key, value in parent.pop(old_name).items():
            if key in target:
                raise ConfigError(
                    f"{new}.{key}: set both directly and through its deprecated alias "
                    f"{old}.{key}; keep only {new}.{key}"
                )
            target[key] = value


def apply_toml_aliases(data: dict[str, Any]) -> dict[str, Any]:
    """Move deprecated sections and keys to their current place (one warning line each)."""
    data = copy.deepcopy(data)
    _move_section_aliases(data)
    for (old_sec, old_key), (new_sec, new_key) in DEPRECATED_ALIASES.items():
        section = data.get(old_sec)
        if isinstance(section, dict) and old_key in section:
            _warn_deprecated((old_sec, old_key), (new_sec, new_key))
            value = section.pop(old_key)
            data.setdefault(new_sec, {})
            if new_key in data[new_sec]:
                raise ConfigError(
                    f"{new_sec}.{new_key}: set both directly and through its deprecated "
                    f"alias {old_sec}.{old_key}; keep only {new_sec}.{new_key}"
                )
            data[new_sec][new_key] = value
    return data


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check a TOML value against the field type (no silent conversions except int->float
    and comma strings -> lists)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for arm in get_args(tp):
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path}: must be one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list or a comma-separated string, got {value!r}")
        return [_coerce(v, item_tp, path) for v in value]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table [{path}], got {value!r}")
        return build_from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _unknown_key_error(key: str, known: list[str], where: str) -> ConfigError:
    hint = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    suggestion = f"; did you mean '{where}{hint[0]}'?" if hint else ""
    kind = "section" if not where else "key"
    return ConfigError(f"{where}{key}: unknown {kind}{suggestion} (valid: {', '.join(known)})")


def build_from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Instantiate dataclass ``cls`` with defaults overridden by ``data`` (checked)."""
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    where = f"{path}." if path else ""
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key_error(key, names, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}{key}")
    return cls(**kwargs)


# ---------------------------------------------------------------------------- custom config


def merge_custom_config(base: type, custom: type) -> type:
    """A JobConfig class with the custom dataclass's sections/fields merged in."""
    base_fields = {f.name: f for f in dataclasses.fields(base)}
    base_hints = get_type_hints(base)
    custom_hints = get_type_hints(custom)
    new_fields = []
    for f in dataclasses.fields(custom):
        tp = custom_hints[f.name]
        if f.name in base_fields and dataclasses.is_dataclass(base_hints[f.name]):
            tp = _merge_section(base_hints[f.name], tp)
            new_fields.append((f.name, tp, dataclasses.field(default_factory=tp)))
        else:
            new_fields.append((f.name, tp, f))
    return dataclasses.make_dataclass(base.__name__, new_fields, bases=(base,))


def _merge_section(base: type, custom: type) -> type:
    hints = get_type_hints(custom)
    fields = [(f.name, hints[f.name], f) for f in dataclasses.fields(custom)]
    return dataclasses.make_dataclass(base.__name__, fields, bases=(base,))


def _load_custom_config(module_name: str, base: type) -> type:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"job.custom_config_module: cannot import {module_name!r}: {e}") from None
    custom = getattr(module, "JobConfig", None)
    if custom is None or not dataclasses.is_dataclass(custom):
        raise ConfigError(
            f"job.custom_config_module: {module_name!r} must define a dataclass named JobConfig"
        )
    return merge_custom_config(base, custom)


# ---------------------------------------------------------------------------- CLI side


def _field_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """Flag name ('section.field') -> type, for every (nested) field."""
    out = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_field_types(tp, f"{name}."))
        else:
            out[name] = tp
    return out


def _normalize_flag(token: str) -> str:
    """'--training.local-batch-size=4' -> '--training.local_batch_size=4'."""
    if not token.startswith("--"):
        return token
    name, eq, value = token[2:].partition("=")
    return "--" + name.replace("-", "_") + eq + value


def _rewrite_cli_aliases(args: list[str]) -> list[str]:
    out = []
    for token in args:
        name, eq, value = token.partition("=")
        for old_sec, new_sec in DEPRECATED_SECTION_ALIASES.items():
            if name.startswith(f"--{old_sec}."):
                _warn_deprecated((old_sec, "*"), (new_sec, "*"))
                name = f"--{new_sec}." + name[len(old_sec) + 3 :]
        for (old_sec, old_key), (new_sec, new_key) in DEPRECATED_ALIASES.items():
            for neg in ("", "no_"):
                if name == f"--{old_sec}.{neg}{old_key}":
                    _warn_deprecated((old_sec, old_key), (new_sec, new_key))
                    name = f"--{new_sec}.{neg}{new_key}"
        out.append(name + eq + value)
    return out


def _check_switches_take_no_value(args: list[str], types_by_flag: dict[str, Any]) -> None:
    """Boolean fields are switches (--x.y on, --x.no_y off); a value given to one would
    otherwise reach tyro as a stray token and be reported without the flag's name."""
    for i, token in enumerate(args):
        name, eq, value = token.partition("=")
        if not name.startswith("--"):
            continue
        section, _, key = name[2:].rpartition(".")
        key = key.removeprefix("no_")
        if types_by_flag.get(f"{section}.{key}") is not bool:
            continue
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value, eq = args[i + 1], "="
        if eq:
            raise ConfigError(
                f"--{section}.{key} is a switch and takes no value (got {value!r}): write "
                f"--{section}.{key} to turn it on or --{section}.no_{key} to turn it off"
            )


def _is_list_type(tp: Any) -> bool:
    if get_origin(tp) in (Union, types.UnionType):
        return any(_is_list_type(a) for a in get_args(tp))
    return get_origin(tp) is list


def _split_comma_lists(args: list[str], types_by_flag: dict[str, Any]) -> list[str]:
    """'--checkpoint.exclude_from_loading a,b' -> '... a b' (tyro wants separate values)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        name, eq, value = token.partition("=")
        is_list = name.startswith("--") and _is_list_type(types_by_flag.get(name[2:]))
        if is_list and eq:
            out.append(name)
            out += [v for v in value.split(",") if v]
        elif is_list and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(token)
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                out += [v for v in args[i].split(",") if v]
                i += 1
            continue
        else:
            out.append(token)
        i += 1
    return out


def _find_flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``args``, as for every other flag: run_train.sh
    passes ``--job.config_file $CONFIG_FILE`` first, and a user's own one must win."""
    value = None
    for i, token in enumerate(args):
        if token == flag and i + 1 < len(args):
            value = args[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


_BOX_CHARS = re.compile(r"[╭╮╰╯│─━┃┏┓┗┛]")
_INVALID_CHOICE = re.compile(
    r"invalid choice (?P<value>.+) for argument '--(?P<field>[\w.]+)'\. Expected one of "
    r"\((?P<choices>.*)\)"
)


def _box_paragraphs(text: str) -> list[str]:
    """tyro prints its error in a box whose text rich wraps over several lines and whose
    sections are separated by rules; return each section's text joined into one line."""
    paragraphs: list[list[str]] = [[]]
    for raw in text.splitlines():
        inner = raw.strip().strip("│").strip()
        if raw.lstrip().startswith(("╭", "╰")):
            continue
        if inner and set(inner) <= set("─━"):
            paragraphs.append([])
            continue
        line = _BOX_CHARS.sub("", raw).strip()
        if line:
            paragraphs[-1].append(line)
    return [" ".join(p) for p in paragraphs if p]


@contextlib.contextmanager
def _unwrapped_console(enabled: bool) -> Iterator[None]:
    """A very wide virtual terminal while tyro parses, so that rich does not wrap its error
    box inside long flag names (the help text keeps the real width)."""
    saved = os.environ.get("COLUMNS")
    if enabled:
        os.environ["COLUMNS"] = "10000"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def _condense_tyro_error(text: str) -> str:
    """tyro's multi-line error box as one line: the message (an invalid choice names its
    field and the valid values) and, for a misspelt flag, the suggestion."""
    paragraphs = _box_paragraphs(text) or ["invalid command line"]
    message = paragraphs[0]
    choice = _INVALID_CHOICE.search(message)
    if choice:
        message = (
            f"--{choice['field']}: invalid choice {choice['value']}; valid: "
            f"{choice['choices'].rstrip(',')}"
        )
    suggestion = next((p for p in paragraphs if p.startswith("Perhaps you meant:")), None)
    if suggestion:
        candidates = _FLAG.findall(suggestion)
        unknown = _FLAG.findall(message)
        best = difflib.get_close_matches(unknown[0], candidates, n=1, cutoff=0) if unknown else []
        if best or candidates:
            message += f"; did you mean {(best or candidates)[0]}?"
    return message + " (see --help)"


_FLAG = re.compile(r"--[A-Za-z0-9_.\-]+")


COMMAND_LINE = "command line"


def _cli_sources(args: list[str]) -> dict[str, str]:
    """'section.key' -> COMMAND_LINE for every flag given (booleans also as --section.no_key)."""
    sources = {}
    for token in args:
        if token.startswith("--"):
            section, _, key = token[2:].partition("=")[0].rpartition(".")
            sources[f"{section}.{key.removeprefix('no_')}"] = COMMAND_LINE
    return sources


class ConfigManager:
    """``parse_args(argv) -> JobConfig``: defaults < TOML (``--job.config_file`` and its
    base configs) < CLI. After parsing, ``sources`` maps each 'section.key' set by a file or
    flag to that file or COMMAND_LINE."""

    def __init__(self, config_cls: type = JobConfig) -> None:
        self.config_cls = config_cls
        self.sources: dict[str, str] = {}

    def parse_args(self, args: list[str] | None = None) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        args = _rewrite_cli_aliases([_normalize_flag(a) for a in args])

        custom_import = _find_flag_value(args, "--experimental.custom_import")
        config_file = _find_flag_value(args, "--job.config_file")
        chain = load_toml_chain(config_file, apply_toml_aliases) if config_file else None
        toml_data = chain.data if chain else {}
        self.sources = {**(chain.sources if chain else {}), **_cli_sources(args)}
        if custom_import is None:
            custom_import = toml_data.get("experimental", {}).get("custom_import") or None
        if custom_import:
            import_custom_module(custom_import)

        config_cls = self.config_cls
        custom_module = _find_flag_value(args, "--job.custom_config_module") or toml_data.get(
            "job", {}
        ).get("custom_config_module")
        if custom_module:
            config_cls = _load_custom_config(custom_module, config_cls)

        for section, value in toml_data.items():
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{section}: top-level keys must be [sections]; got {section} = {value!r}"
                )
        default = build_from_dict(config_cls, toml_data)
        types_by_flag = _field_types(config_cls)
        _check_switches_take_no_value(args, types_by_flag)
        args = _split_comma_lists(args, types_by_flag)
        config = self._parse_cli(config_cls, args, default)
        _apply_value_aliases(config)
        check_job_config(config)
        resolve_hf_assets_path(config.model)
        return config

    @staticmethod
    def _parse_cli(config_cls: type, args: list[str], default: Any) -> Any:
        stderr = io.StringIO()
        wants_help = "--help" in args or "-h" in args
        try:
            with contextlib.redirect_stderr(stderr), _unwrapped_console(not wants_help):
                return tyro.cli(config_cls, args=args, default=default, use_underscores=True)
        except SystemExit as e:
            if e.code in (0, None):
                raise
            raise ConfigError(_condense_tyro_error(stderr.getvalue())) from None


def import_custom_module(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"experimental.custom_import: cannot import {name!r}: {e}") from None


def config_to_toml(config: Any, sources: dict[str, str] | None = None) -> str:
    """Render a config as TOML (for printing the merged config). With ``sources``
    ('section.key' -> file or COMMAND_LINE) every line says where its value came from
    ('default' when from neither)."""
    lines: list[str] = []
    _emit_table(dataclasses.asdict(config), "", lines, sources)
    return "\n".join(lines).strip() + "\n"


def _emit_table(
    table: dict[str, Any], prefix: str, lines: list[str], sources: dict[str, str] | None
) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    if prefix and scalars:
        lines.append(f"\n[{prefix}]")
    for key, value in scalars.items():
        rendered = _toml_value(value)
        line = f"{key} = {rendered}" if rendered is not None else f"# {key} = (unset)"
        if sources is not None:
            line += f"  # from {sources.get(f'{prefix}.{key}', 'default')}"
        lines.append(line)
    for key, value in table.items():
        if isinstance(value, dict):
            _emit_table(value, f"{prefix}.{key}" if prefix else key, lines, sources)


def save_config_file(config: Any) -> str | None:
    """Write the merged config to job.save_config_file (relative to job.dump_folder; JSON for
    a .json name, else TOML) and return the path written, or None when unset."""
    name = config.job.save_config_file
    if not name:
        return None
    path = os.path.join(config.job.dump_folder, name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if name.endswith(".json"):
        text = json.dumps(dataclasses.asdict(config), indent=2) + "\n"
    else:
        text = config_to_toml(config)
    with open(path, "w") as f:
        f.write(text)
    return path


def _toml_value(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) or '""' for v in value) + "]"
    return repr(value)
