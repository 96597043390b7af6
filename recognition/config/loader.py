"""Loading and saving configs: YAML files with their `base:` chain, dotted command-line
overrides (parsed as YAML scalars), then conversion to `ExperimentConfig`.

A bare name resolves to `configs/NAME.yaml`; a file may name a `base:` file that it overrides
key by key: a path beside the file, else (a bare name) `configs/NAME.yaml`, so that a copy of
a shipped config works from anywhere. What no file sets is the dataclasses' default (the
built-in run, docs/configuration.md). Every error is a `ConfigError` naming the file or the
dotted key; `load_config_sources` also says which file (or the command line) set each key.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from recognition.config.convert import build_dataclass
from recognition.config.experiment import ExperimentConfig
from recognition.config.values import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"


def resolve_config_path(name_or_path: str) -> Path:
    """A bare name resolves to configs/NAME.yaml; anything else is a path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists() or len(path.parts) > 1:
        if not path.is_file():
            raise ConfigError(f"--config: no such file {str(path)!r}")
        return path
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(
            f"--config: no config named {name_or_path!r} in {CONFIG_DIR} "
            f"(known: {', '.join(known) or 'none'})"
        )
    return candidate


COMMAND_LINE = "command line"
"""The source of a key set by a `key=value` override (`load_config_sources`)."""


def load_config(
    name_or_path: str = "default", overrides: list[str] | None = None
) -> ExperimentConfig:
    """Load a config file (with its `base:` chain), apply dotted overrides, validate."""
    return load_config_sources(name_or_path, overrides)[0]


def load_config_sources(
    name_or_path: str = "default", overrides: list[str] | None = None
) -> tuple[ExperimentConfig, dict[str, str]]:
    """`load_config`'s config, and {dotted key: what set it}: a file's path (the last of the
    `base:` chain that names the key) or COMMAND_LINE; a key none of them sets is left out
    (it holds its default)."""
    path = resolve_config_path(name_or_path)
    layers = _read_layers(path, seen=())
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer_path, data in layers:
        raw = _deep_merge(raw, data)
        sources.update(dict.fromkeys(_leaf_keys(data), str(layer_path)))
    raw.setdefault("name", path.stem)
    for item in overrides or []:
        _apply_override(raw, item)
        sources.update(dict.fromkeys(_leaf_keys(_override_dict(item)), COMMAND_LINE))
    for key in _followers_follow(raw, overrides or []):
        sources[key] = COMMAND_LINE
    return config_from_dict(raw), sources


def _leaf_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of `data`'s values that are not mappings (a list is one value)."""
    keys = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            keys += _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def _override_dict(item: str) -> dict[str, Any]:
    """The override `item` (key=value, already applied without error) as a nested mapping."""
    raw: dict[str, Any] = {}
    _apply_override(raw, item)
    return raw


# (section, key, value, follower): that value set on the command line makes the config
# file's `follower` of the same section meaningless, so it becomes null, unless the command
# line sets it too (then a conflict is an error that names the override to add).
FOLLOWERS = (
    ("eval", "targets", [], "best_metric"),  # it names one of the targets just removed
    ("data", "num_workers", 0, "prefetch_factor"),  # batches each worker loads ahead
)


def _followers_follow(raw: dict[str, Any], overrides: list[str]) -> list[str]:
    """Set to null the file's followers (`FOLLOWERS`) of what the command line set; returns
    their dotted keys."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    nulled = []
    for section_name, key, value, follower in FOLLOWERS:
        section = raw.get(section_name)
        if f"{section_name}.{key}" not in keys or f"{section_name}.{follower}" in keys:
            continue
        if isinstance(section, dict) and section.get(key) == value:
            if section.get(follower) is not None:
                section[follower] = None
                nulled.append(f"{section_name}.{follower}")
    return nulled


def config_from_dict(raw: dict[str, Any]) -> ExperimentConfig:
    """Build and validate an ExperimentConfig from a plain mapping (not changed)."""
    raw = copy.deepcopy(raw)
    _expand_shorthands(raw)
    _read_old_flip(raw)
    return build_dataclass(ExperimentConfig, raw, prefix="")


# (section, key, field): a plain value of `section.key` stands for its `field`, e.g.
# `data.augment=face` for data.augment.preset=face.
SHORTHANDS = (("data", "augment", "preset"),)


def _expand_shorthands(raw: dict[str, Any]) -> None:
    """Replace each shorthand value (`SHORTHANDS`) of `raw` by the mapping it stands for."""
    for section_name, key, field in SHORTHANDS:
        section = raw.get(section_name)
        if isinstance(section, dict) and isinstance(section.get(key), str):
            section[key] = {field: section[key]}


def _read_old_flip(raw: dict[str, Any]) -> None:
    """`data.flip` (a bool, before data.augment) as what it meant: data.augment.flip 0.5 or 0.

    Config files and the config.yaml of runs made before data.augment keep loading; the
    config they resolve to names data.augment.flip only.
    """
    data = raw.get("data")
    if not isinstance(data, dict) or "flip" not in data:
        return
    flip = data.pop("flip")
    if not isinstance(flip, bool):
        raise ConfigError(
            f"data.flip: expected true or false, got {flip!r} (data.flip is the old name of "
            "data.augment.flip, a probability)"
        )
    augment = data.get("augment")
    if augment is None:
        augment = data["augment"] = {}
    if not isinstance(augment, dict):
        return  # build_dataclass names data.augment
    value = 0.5 if flip else 0.0
    if augment.get("flip") is not None and augment["flip"] != value:
        raise ConfigError(
            f"data.flip: {str(flip).lower()} (data.augment.flip={value:g}) conflicts with "
            f"data.augment.flip={augment['flip']}; set data.augment.flip alone"
        )
    augment["flip"] = value


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A config (or one of its sections) as plain nested dicts and lists."""
    return dataclasses.asdict(cfg)


def save_config(cfg: ExperimentConfig, path: Path) -> None:
    """Write the resolved config as YAML (a file `load_config` reads back unchanged)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "save the config as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def _read_layers(path: Path, seen: tuple[Path, ...]) -> list[tuple[Path, dict[str, Any]]]:
    """The files of `path`'s `base:` chain, the first base first, each with its keys (less
    `base:`)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: `base:` chain loops back to itself")
    data = _read_yaml(path)
    _expand_shorthands(data)  # before merging: `augment: face` over a base's mapping
    base = data.pop("base", None)
    if base is None:
        return [(path, data)]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base: must be a file name")
    return [*_read_layers(resolve_base(path, base), seen + (path,)), (path, data)]


def resolve_base(path: Path, base: str) -> Path:
    """The file the `base:` of the config `path` names: beside `path` (`.yaml` added to a
    name without a suffix), else, for a bare name, `configs/NAME.yaml`. Raises ConfigError
    naming every place tried."""
    beside = Path(base) if Path(base).is_absolute() else path.parent / base
    if beside.suffix == "":
        beside = beside.with_suffix(".yaml")
    tried = [beside]
    if len(Path(base).parts) == 1:
        tried.append(CONFIG_DIR / beside.name)
    for candidate in tried:
        if candidate.is_file():
            return candidate
    places = " and ".join(repr(str(p)) for p in dict.fromkeys(tried))
    raise ConfigError(f"{path}: base: no file {base!r} (looked for {places})")


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. optim.lr=0.05)")
    key, text = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {text!r}: {exc}") from exc
    _expand_shorthands(raw)  # `data.augment=face data.augment.crop=0` sets both
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"{key}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value
