"""Config loading: YAML + base chain + dotted overrides, typed, with dotted-key errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from recognition.config import (
    CONFIG_DIR,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    config_from_dict,
    load_config,
    parse_image_size,
    save_config,
)


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_shipped_config_loads():
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert "default" in names
    for name in names:
        cfg = load_config(name)
        assert cfg.name == name


def test_bare_name_resolves_to_configs_dir():
    cfg = load_config("default")
    assert cfg.name == "default"
    assert cfg.data.synthetic.enabled


def test_overrides_are_typed_and_dotted(tmp_path):
    path = write(tmp_path / "exp.yaml", {"optim": {"lr": 0.1}})
    cfg = load_config(
        str(path),
        [
            "head.margin=cosface",
            "optim.lr=0.05",
            "train.max_steps=7",
            "optim.weight_decay=1e-4",
            "precision.level=O2",
        ],
    )
    assert cfg.head.margin == "cosface"
    assert cfg.optim.lr == 0.05
    assert cfg.train.max_steps == 7
    # YAML 1.1 reads 1e-4 as a string; a float field must still take it as a number.
    assert cfg.optim.weight_decay == pytest.approx(1e-4)
    assert cfg.precision.level == "O2"
    assert cfg.name == "exp"


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lrr=0.1", "optim.lrr"),
        ("nosuchsection.x=1", "nosuchsection"),
        ("train.batch_size=abc", "train.batch_size"),
        ("train.batch_size=1.5", "train.batch_size"),
        ("head.margin=softmax", "head.margin"),
        ("precision.level=O4", "precision.level"),
        ("precision.dtype=fp8", "precision.dtype"),
        ("head.sample_rate=0", "head.sample_rate"),
        ("head.m1=1.0", "head.m1"),
        ("train.epochs=0", "train.epochs"),
        ("data.synthetic.bogus=1", "data.synthetic.bogus"),
        ("model.backbone.width=2", "model.backbone"),
        ("optim.lr", "optim.lr"),
    ],
)
def test_bad_overrides_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("default", [override])


@pytest.mark.parametrize(
    "key",
    [
        "train.batch_size",
        "train.epochs",
        "train.accumulate_steps",
        "train.log_every",
        "train.keep_checkpoints",
        "train.max_nonfinite_steps",
        "eval.batch_size",
    ],
)
def test_counts_below_one_are_refused_by_name(key):
    with pytest.raises(ConfigError, match=f"^{key}: must be at least 1$"):
        load_config("default", [f"{key}=0"])


@pytest.mark.parametrize("key", ["train.max_steps", "train.checkpoint_every", "eval.every_steps"])
def test_optional_counts_below_one_say_null_is_allowed(key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be at least 1 \(or null\)$"):
        load_config("default", [f"{key}=0"])
    load_config("default", [f"{key}=null"])


def test_bool_is_not_an_int_and_int_is_a_float():
    with pytest.raises(ConfigError, match="train.batch_size"):
        config_from_dict({"train": {"batch_size": True}})
    cfg = config_from_dict({"optim": {"lr": 1}})
    assert isinstance(cfg.optim.lr, float)


def test_resume_takes_bool_or_path():
    assert config_from_dict({"train": {"resume": True}}).train.resume is True
    assert config_from_dict({"train": {"resume": "auto"}}).train.resume == "auto"
    with pytest.raises(ConfigError, match="train.resume"):
        config_from_dict({"train": {"resume": 3}})


def test_base_chain_merges_sections(tmp_path):
    write(
        tmp_path / "base.yaml",
        {"model": {"backbone": "iresnet18", "width": 0.5}, "optim": {"lr": 0.2}},
    )
    child = write(tmp_path / "child.yaml", {"base": "base.yaml", "model": {"width": 0.25}})
    cfg = load_config(str(child))
    assert cfg.model.backbone == "iresnet18"
    assert cfg.model.width == 0.25
    assert cfg.optim.lr == 0.2


def test_base_loop_is_refused(tmp_path):
    write(tmp_path / "a.yaml", {"base": "b.yaml"})
    write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError, match="loops"):
        load_config(str(tmp_path / "a.yaml"))


def test_unknown_key_in_file_names_file_key(tmp_path):
    path = write(tmp_path / "bad.yaml", {"train": {"batchsize": 3}})
    with pytest.raises(ConfigError, match=r"train\.batchsize"):
        load_config(str(path))


def test_missing_config_name_lists_known():
    with pytest.raises(ConfigError, match="known:.*default"):
        load_config("no_such_config")


def test_eval_targets_list_of_sections():
    cfg = config_from_dict({"eval": {"targets": [{"pairs": "a/pairs.txt"}]}})
    assert cfg.eval.targets[0].pairs == "a/pairs.txt"
    with pytest.raises(ConfigError, match=r"eval\.targets\[0\]\.pairs"):
        config_from_dict({"eval": {"targets": [{"images": "x"}]}})


def test_saved_config_round_trips(tmp_path):
    cfg = load_config("default", ["optim.lr=0.03", "head.margin=cosface"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == cfg
    assert isinstance(again, ExperimentConfig)


@pytest.mark.parametrize("value, expected", [("112", 112), ("[256, 128]", [256, 128])])
def test_image_size_is_one_side_or_height_width(value, expected, tmp_path):
    cfg = load_config("default", [f"data.image_size={value}", f"eval.image_size={value}"])
    assert cfg.data.image_size == expected and cfg.eval.image_size == expected
    # A list stays a list in config.yaml, and loads back the same.
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml")) == cfg


@pytest.mark.parametrize(
    "value", ["[256]", "[0, 128]", "[256, 8]", "big", "8", "true", "[256, 128, 3]", "[256, x]"]
)
@pytest.mark.parametrize("key", ["data.image_size", "eval.image_size"])
def test_bad_image_size_names_the_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("default", [f"{key}={value}"])


def test_image_size_from_python_and_the_command_line():
    # A tuple (from Python code) is kept as the list YAML would give.
    assert DataConfig(image_size=(64, 32)).image_size == [64, 32]
    assert parse_image_size("112", "--image-size") == 112
    assert parse_image_size("256x128", "--image-size") == (256, 128)
    for text in ("big", "256x", "1x2x3", "8x8"):
        with pytest.raises(ConfigError, match="--image-size"):
            parse_image_size(text, "--image-size")


# ---- what a newcomer trips on (issue 39): copied configs, one set of defaults ------------


def test_a_copied_config_finds_its_base_in_configs(tmp_path):
    # `cp configs/ms1m_arcface.yaml mine.yaml`: its `base: face_base` is not beside the copy.
    mine = tmp_path / "mine.yaml"
    mine.write_text((CONFIG_DIR / "ms1m_arcface.yaml").read_text())
    copied = load_config(str(mine))
    shipped = load_config("ms1m_arcface")
    assert copied.name == "mine"
    copied.name = shipped.name
    assert copied == shipped
    # A base beside the file still wins over the one of that name in configs/.
    write(tmp_path / "face_base.yaml", {"model": {"backbone": "iresnet34"}})
    assert load_config(str(mine)).model.backbone == "iresnet34"


def test_a_missing_base_names_both_places_tried(tmp_path):
    path = write(tmp_path / "mine.yaml", {"base": "no_such_base"})
    with pytest.raises(ConfigError) as raised:
        load_config(str(path))
    message = str(raised.value)
    assert str(tmp_path / "no_such_base.yaml") in message
    assert str(CONFIG_DIR / "no_such_base.yaml") in message


def test_a_config_without_base_is_the_built_in_run(tmp_path):
    # One set of defaults: what a file that names no base gets is what `python train.py`
    # (configs/default.yaml) runs, key for key.
    bare = load_config(str(write(tmp_path / "default.yaml", {})))
    assert bare == load_config("default")
    assert ExperimentConfig(name="default") == load_config("default")


def test_backbone_names_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"^model\.backbone: unknown 'iresnet52' \(choose"):
        load_config("default", ["model.backbone=iresnet52"])


def test_every_bad_key_is_reported_at_once():
    bad = ["model.backbone=iresnet52", "head.margin=foo", "optim.lr=x", "train.bogus=1"]
    with pytest.raises(ConfigError) as raised:
        load_config("default", [*bad, "data.image_size=8"])
    lines = str(raised.value).splitlines()
    keys = sorted(line.split(":", 1)[0] for line in lines)
    assert keys == sorted(
        ["data.image_size", "head.margin", "model.backbone", "optim.lr", "train.bogus"]
    ), lines


@pytest.mark.parametrize("key", ["data.image_size", "eval.image_size"])
def test_image_size_takes_hxw_as_the_command_lines_do(key):
    cfg = load_config("default", [f"{key}=112x96"])
    assert getattr(cfg, key.split(".")[0]).image_size == [112, 96]
    assert list(parse_image_size("112x96", "--image-size")) == [112, 96]
    for bad in ("112x", "8x8"):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config("default", [f"{key}={bad}"])


def test_the_config_loads_without_torch():
    # The checks of every name (backbones, margins, formats) read the registry's names: not
    # one import of torch, so that a bad key is said in a fraction of a second.
    import subprocess
    import sys

    code = (
        "import sys, train\n"
        "assert train.main(['--show-config', 'model.backbone=iresnet52']) == 2\n"
        "assert train.main(['--show-config', '--config', 'ms1m_adaface']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_backbone_of_fixed_widths_is_told_at_load_to_keep_width_one():
    # resnet50_reid has torchvision's widths: the built-in run's width 1/8 is refused when the
    # config loads (it used to fail once torch had loaded and the model was built).
    with pytest.raises(ConfigError, match=r"^model\.width: resnet50_reid has fixed widths"):
        load_config("default", ["model.backbone=resnet50_reid"])
    reid = load_config("default", ["model.backbone=resnet50_reid", "model.width=1"])
    assert reid.model.width == 1
