"""recognition.compat.interpreter_scalars_as_indices: Triton 3.6's interpreter under NumPy
2.4 and later. The pinned Triton does not need it, so its interpreter's tensor patch is
replaced here by one written as Triton 3.6's is (`__index__` = `int` of the 1-element
array that holds a scalar kernel argument), and a scalar is used as `range`'s bound, as the
head's forward kernel does."""

from __future__ import annotations

import types

import numpy as np
import pytest

from recognition import compat

interpreter = pytest.importorskip("triton.runtime.interpreter")


class Scope:
    """What the interpreter's patch is given: set_attr(obj, name, value)."""

    def set_attr(self, obj, name, value) -> None:
        setattr(obj, name, value)


def as_in_triton_3_6(tensor, scope) -> None:
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))


def scalar_argument(value: int):
    """A stand-in for the interpreter's tensor of a scalar kernel argument."""
    tensor_class = type("tensor", (), {})
    as_patched = interpreter._patch_lang_tensor
    as_patched(tensor_class, Scope())
    tensor = tensor_class()
    tensor.handle = types.SimpleNamespace(data=np.array([value], dtype=np.int32))
    return tensor


def test_a_scalar_argument_bounds_a_range_once_the_fix_is_applied(monkeypatch):
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", as_in_triton_3_6)
    compat.interpreter_scalars_as_indices()
    assert list(range(0, scalar_argument(3))) == [0, 1, 2]
    patched = interpreter._patch_lang_tensor
    compat.interpreter_scalars_as_indices()  # idempotent: not wrapped twice
    assert interpreter._patch_lang_tensor is patched


@pytest.mark.skipif(
    tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4),
    reason="NumPy < 2.4 still converts a 1-element array (with a DeprecationWarning)",
)
def test_without_the_fix_numpy_refuses_the_index(monkeypatch):
    # What the fix is for: the unpatched conversion fails on this NumPy.
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", as_in_triton_3_6)
    with pytest.raises(TypeError, match="0-dimensional"):
        range(0, scalar_argument(3))
