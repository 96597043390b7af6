"""How checkpoint parts become flat entries and back.

A part is a `Stateful` (`state_dict()` / `load_state_dict()`: a module, an optimizer
adapter, Precision, a scheduler) or a plain value. A Stateful part's state dict is
flattened into entries `<part>/<key>` wherever it holds tensors; anything else is one entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# What `unflatten` returns for a leaf the loaded entries lack.
MISSING = object()


def flatten_state(parts: Mapping[str, Any]) -> dict[str, Any]:
    """The flat entries (name -> tensor or object) that `save_checkpoint` writes for `parts`.

    A Stateful part's `state_dict()` is flattened: a dict that holds tensors becomes one
    entry per key, "<part>/<key>" (recursively: "optimizer/state/3/momentum_buffer"), and
    anything else (a dict without tensors, a list, a number) is one entry. A plain value
    is one entry under its name.
    """
    state: dict[str, Any] = {}
    for name, part in parts.items():
        if is_stateful(part):
            flatten(name, part.state_dict(), state)
        else:
            state[name] = part
    return state


def is_stateful(value: Any) -> bool:
    return (
        not torch.is_tensor(value)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Add `value`'s entries under `prefix` to `out` (see `flatten_state`)."""
    if isinstance(value, Mapping) and _holds_tensor(value):
        for key, item in value.items():
            flatten(f"{prefix}/{key}", item, out)
    else:
        out[prefix] = value


def unflatten(prefix: str, template: Any, loaded: Mapping[str, Any]) -> Any:
    """`template`'s structure (and key types) with the loaded leaves; missing leaves left out."""
    if isinstance(template, Mapping) and _holds_tensor(template):
        out = {}
        for key, item in template.items():
            value = unflatten(f"{prefix}/{key}", item, loaded)
            if value is not MISSING:
                out[key] = value
        return out
    return loaded.get(prefix, MISSING)


def _holds_tensor(value: Mapping) -> bool:
    return any(
        torch.is_tensor(v) or (isinstance(v, Mapping) and _holds_tensor(v)) for v in value.values()
    )
