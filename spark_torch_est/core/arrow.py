"""[both] Arrow arrays to numpy and back without pyarrow's pandas bridge.

``pa.array(...)``, ``pa.scalar(...)`` and ``Array.to_numpy()`` import pandas in a process that
has not (pyarrow checks whether its argument is a pandas object). A task needs pandas for
nothing else, and the import costs about 0.2 s of CPU in every fresh Python worker: on 16 ranks
sharing 2 cores, over a second of the launch. The tasks' code converts through these instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

__all__ = ["to_numpy", "from_numpy", "binary_array"]


def to_numpy(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The values of an array: a read-only view of its buffer for numbers (as ``to_numpy``
    gives), a new array for booleans (Arrow packs them in bits); an array with nulls and
    other types go through pyarrow's own conversion."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        return array.to_numpy(zero_copy_only=False)
    kind = array.type
    if pa.types.is_boolean(kind):
        data = array.buffers()[1]
        if data is None:
            return np.zeros(0, dtype=bool)
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
        return bits[array.offset:array.offset + len(array)].astype(bool)
    dtype = _numpy_dtype(kind)
    if dtype is None:
        return array.to_numpy(zero_copy_only=False)
    data = array.buffers()[1]
    if data is None:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype)[array.offset:array.offset + len(array)]


def from_numpy(values: np.ndarray | Sequence[int] | Sequence[float]) -> pa.Array:
    """A one-dimensional array of numbers as an Arrow array over the same memory (numbers
    given as a list are copied into numpy first)."""
    values = np.ascontiguousarray(values)
    if values.ndim != 1 or values.dtype.kind not in "iuf":
        raise TypeError(f"from_numpy takes one dimension of numbers, not {values.dtype} of shape {values.shape}")
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def binary_array(items: Sequence[bytes]) -> pa.Array:
    """``items`` as an Arrow ``binary`` array.

    Raises:
        OverflowError: The items hold 2 GiB or more in all, past ``binary``'s 32-bit offsets.
    """
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([len(item) for item in items], out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise OverflowError(f"{int(offsets[-1])} bytes do not fit one Arrow binary array (at most 2 GiB - 1)")
    offsets = offsets.astype(np.int32)
    return pa.Array.from_buffers(pa.binary(), len(items), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(items))])


def _numpy_dtype(kind: pa.DataType) -> np.dtype | None:
    if pa.types.is_floating(kind):
        return np.dtype(f"f{kind.bit_width // 8}")
    if pa.types.is_integer(kind):
        return np.dtype(f"{'i' if pa.types.is_signed_integer(kind) else 'u'}{kind.bit_width // 8}")
    return None
