"""Reading a GGUF file: metadata, tensor directory and memory-mapped tensor data.

The `gguf` package supplies the format's constants and the dequantization kernels. We parse the
header ourselves because ``gguf.GGUFReader`` builds a numpy memmap view for every string of
the vocabulary (~10 s for a 49k-token vocabulary); a linear pass over the bytes takes ~0.1 s.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from .config import ModelLoadError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # PyTorch order (GGUF stores dimensions innermost first)
    qtype: GGMLQuantizationType
    raw: np.ndarray  # uint8 view into the memory map, [rows, bytes per row]

    def share(self, dim: int, lo: int, hi: int) -> GGUFTensor | None:
        """Rows (``dim`` 0) or the last dimension's columns (``dim`` 1 of a matrix, 0 of a vector)
        [lo, hi) as a tensor of their own, a view of only their bytes; None for columns that
        split a quantization block (K-quants have 256 per block)."""
        if (lo, hi) == (0, self.shape[dim]):
            return self
        shape = (*self.shape[:dim], hi - lo, *self.shape[dim + 1 :])
        if dim < len(self.shape) - 1:
            return GGUFTensor(self.name, shape, self.qtype, self.raw[lo:hi])
        block, size = GGML_QUANT_SIZES[self.qtype]
        if lo % block or hi % block:
            return None
        return GGUFTensor(self.name, shape, self.qtype, self.raw[:, lo // block * size : hi // block * size])

    def to_float32(self, dim: int = 0, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The tensor, or its rows / columns [lo, hi) (see :meth:`share`), dequantized."""
        hi = self.shape[dim] if hi is None else hi
        part = self.share(dim, lo, hi)
        if part is None:  # whole blocks dequantized, then cut
            return self.to_float32().take(np.arange(lo, hi), axis=dim)
        try:
            return quants.dequantize(np.ascontiguousarray(part.raw), self.qtype).reshape(part.shape)
        except NotImplementedError:
            raise ModelLoadError(f"tensor {self.name}: quantization {self.qtype.name} is not supported") from None


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        try:
            self._buf = np.memmap(path, dtype=np.uint8, mode="r")
            self.metadata, self.tensors = self._parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError, OverflowError) as e:
            raise ModelLoadError(f"{path}: truncated or invalid GGUF file ({e})") from None

    def _parse(self):
        buf, pos = memoryview(self._buf), 0

        def take(fmt):
            nonlocal pos
            value = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return value

        def string():
            nonlocal pos
            n = take("<Q")
            if pos + n > len(buf):
                raise ValueError("string runs past the end of the file")
            s = bytes(buf[pos : pos + n]).decode("utf-8", errors="surrogateescape")
            pos += n
            return s

        def value(kind):
            nonlocal pos
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, count = take("<I"), take("<Q")
                if item == _STRING:
                    return [string() for _ in range(count)]
                if item == _ARRAY:
                    return [value(take("<I")) for _ in range(count)]
                dt = np.dtype(_NUMPY[item])
                arr = np.frombuffer(buf, dtype=dt, count=count, offset=pos)
                pos += dt.itemsize * count
                return arr.tolist()
            return take(_SCALARS[kind])

        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("bad magic")
        pos = 4
        version = take("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = take("<Q"), take("<Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("<Q") for _ in range(take("<I"))]
            infos.append((name, dims, GGMLQuantizationType(take("<I")), take("<Q")))
        align = int(meta.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        tensors = {}
        for name, dims, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            row_bytes = dims[0] // block * type_size
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            start = data_start + offset
            if start + rows * row_bytes > len(self._buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            raw = self._buf[start : start + rows * row_bytes].reshape(rows, row_bytes)
            tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qtype, raw)
        return meta, tensors
