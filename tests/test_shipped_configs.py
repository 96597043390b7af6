"""Every shipped config resolves to the values recorded in tests/data/shipped_configs.json.

The record was written from the configs as they resolved before the defaults moved into one
place (the dataclasses hold the built-in run's values, face_base.yaml the face recipe): a
change to a default, a base file or a config that moves a shipped run fails here, naming the
config and the key. A key added since (with its default) is not in the record and not
compared. After a deliberate change, write the record again:

    PYTHONPATH=. python tests/test_shipped_configs.py --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from recognition.config import CONFIG_DIR, config_to_dict, load_config

RECORD = Path(__file__).resolve().parent / "data" / "shipped_configs.json"


def resolved(name: str) -> dict:
    """The config `name` as it loads, as plain JSON data (tuples as lists)."""
    return json.loads(json.dumps(config_to_dict(load_config(name))))


def differences(recorded, now, key: str = "") -> list[str]:
    """The dotted keys whose recorded value `now` does not hold (keys only `now` has, in
    sections or in a list's sections, are new fields, not differences)."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        found = []
        for name, value in recorded.items():
            where = f"{key}.{name}" if key else name
            if name not in now:
                found.append(f"{where}: gone")
            else:
                found += differences(value, now[name], where)
        return found
    if isinstance(recorded, list) and isinstance(now, list) and len(recorded) == len(now):
        # A list of sections (eval.targets): item by item, so that a field added since is new.
        return [
            d
            for i, (r, n) in enumerate(zip(recorded, now, strict=True))
            for d in differences(r, n, f"{key}[{i}]")
        ]
    return [] if recorded == now else [f"{key}: {recorded!r} then, {now!r} now"]


RECORDED = json.loads(RECORD.read_text()) if RECORD.is_file() else {}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_a_shipped_config_resolves_as_recorded(name):
    assert (CONFIG_DIR / f"{name}.yaml").is_file(), f"configs/{name}.yaml is gone"
    assert not differences(RECORDED[name], resolved(name)), differences(
        RECORDED[name], resolved(name)
    )


def test_every_shipped_config_is_recorded():
    shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    unrecorded = [name for name in shipped if name not in RECORDED]
    assert not unrecorded, f"not in {RECORD.name}: {unrecorded}; write it again (module doc)"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=. python tests/test_shipped_configs.py --write")
    record = {p.stem: resolved(p.stem) for p in sorted(CONFIG_DIR.glob("*.yaml"))}
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
