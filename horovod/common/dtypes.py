"""The element types the collectives accept, with upstream's wire codes.

Must not touch: any layer above it; framework dtypes (frameworks map theirs to NumPy's).
"""

from __future__ import annotations

import numpy as np

try:  # bfloat16 comes from ml_dtypes (a dependency; also shipped with JAX and TensorFlow)
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a declared dependency
    BFLOAT16 = None

# Upstream's DataType enum, plus bfloat16 (upstream C++ has it as 10 in later versions).
_CODES: list[tuple[int, str, np.dtype | None]] = [
    (0, "uint8", np.dtype(np.uint8)),
    (1, "int8", np.dtype(np.int8)),
    (2, "uint16", np.dtype(np.uint16)),
    (3, "int16", np.dtype(np.int16)),
    (4, "int32", np.dtype(np.int32)),
    (5, "int64", np.dtype(np.int64)),
    (6, "float16", np.dtype(np.float16)),
    (7, "float32", np.dtype(np.float32)),
    (8, "float64", np.dtype(np.float64)),
    (9, "bool", np.dtype(np.bool_)),
    (10, "bfloat16", BFLOAT16),
]

CODE_OF: dict[np.dtype, int] = {dt: code for code, _, dt in _CODES if dt is not None}
NAME_OF_CODE: dict[int, str] = {code: name for code, name, _ in _CODES}
DTYPE_OF_CODE: dict[int, np.dtype] = {code: dt for code, _, dt in _CODES if dt is not None}
BOOL = 9
FLOATING = frozenset({6, 7, 8, 10})
SUPPORTED_NAMES = ", ".join(name for _, name, dt in _CODES if dt is not None)


def code_of(dtype: np.dtype, what: str) -> int:
    """The wire code of ``dtype``; a ValueError naming the op and the accepted types otherwise."""
    try:
        return CODE_OF[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(
            f"{what}: dtype {dtype} is not supported; use one of {SUPPORTED_NAMES}"
        ) from None
