"""Element types on the wire: a stable one-byte code per dtype name.

The names are those numpy and torch share (``"float32"``, ``"bfloat16"``, ...).  Code 0
means "raw bytes" (object collectives, barrier tokens).
"""

from __future__ import annotations

DTYPE_CODES: dict[str, int] = {
    "bytes": 0,
    "bool": 1,
    "int8": 2,
    "uint8": 3,
    "int16": 4,
    "uint16": 5,
    "int32": 6,
    "uint32": 7,
    "int64": 8,
    "uint64": 9,
    "float16": 10,
    "bfloat16": 11,
    "float32": 12,
    "float64": 13,
    "complex64": 14,
    "complex128": 15,
    # torch's 8-bit floats: CUDA tensors only (numpy has none; chorus.buffers refuses them
    # on the CPU); codes for fingerprints and errors
    "float8_e4m3fn": 16,
    "float8_e5m2": 17,
    "float8_e4m3fnuz": 18,
    "float8_e5m2fnuz": 19,
}
DTYPE_NAMES: dict[int, str] = {code: name for name, code in DTYPE_CODES.items()}


def dtype_code(name: str) -> int:
    """The wire code of dtype ``name``; ValueError names the supported dtypes."""
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} cannot be communicated; supported: {', '.join(DTYPE_CODES)}"
        ) from None


def dtype_name(code: int) -> str:
    return DTYPE_NAMES.get(code, f"<unknown dtype code {code}>")


def is_known_dtype_code(code: int) -> bool:
    return code in DTYPE_NAMES
