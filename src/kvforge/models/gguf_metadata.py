"""A small reader of GGUF file headers: metadata fields and the tensor directory.

Used instead of `gguf.GGUFReader` for speed: GGUFReader builds numpy views of every element
of every metadata array, which is slow for a large vocabulary (Gemma3's has 262K entries);
this reader skips long arrays (docs/benchmarks.md#measurements-behind-design-choices).
Tensor *data* is still decoded by the `gguf` package. The tests cross-check this reader with
GGUFReader.
"""

from __future__ import annotations

import mmap
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from kvforge.errors import ModelLoadError

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Metadata arrays longer than this (vocabularies, merges, scores) are skipped, only their
# length is kept: nothing in the model config needs their contents, and the tokenizer is
# built by transformers from the file itself.
_MAX_ARRAY_VALUES = 1024

# GGUF metadata value types (gguf.GGUFValueType): type id -> struct format of a scalar.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def float32_decimal(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips in float32.

    GGUF stores 1e-5 as 9.99999974e-06; config.json says 1e-05. Using the short decimal makes
    configs from GGUF and from config.json compare equal.
    """
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file.

    `dims` is GGUF's order (fastest-varying first, ggml's ne[0] first); `shape` is the
    reverse, i.e. the row-major numpy/PyTorch shape: (out_features, in_features) for a
    linear weight, exactly what `gguf.quants.dequantize` returns.
    """

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFMetadata:
    """Key/value metadata and tensor directory of a GGUF file (no tensor data)."""

    path: Path
    version: int
    fields: Mapping[str, Any]  # scalars, strings and short arrays (as lists)
    array_lengths: Mapping[str, int]  # length of every array field, including skipped ones
    tensors: Mapping[str, GGUFTensorInfo]  # in file order
    byte_order: str  # "<" or ">" (struct notation)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    """Sequential little/big-endian reads over a buffer; raises ModelLoadError when truncated."""

    def __init__(self, buf: memoryview, path: Path, byte_order: str) -> None:
        self.buf, self.path, self.order, self.pos = buf, path, byte_order, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(self.order + fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        return self.raw_string().decode("utf-8", errors="replace")

    def raw_string(self) -> bytes:
        length = self.unpack("Q")
        if self.pos + length > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated GGUF string at byte {self.pos}")
        data = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        return data

    def skip_string(self) -> None:
        length = self.unpack("Q")  # not `self.pos += self.unpack(...)`: that reads pos first
        self.pos += length

    def value(self, value_type: int, key: str, array_lengths: dict[str, int]) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            elem_type, count = self.unpack("I"), self.unpack("Q")
            array_lengths[key] = count
            if count > _MAX_ARRAY_VALUES:
                self._skip_array(elem_type, count, key)
                return None
            return [self.value(elem_type, key, array_lengths) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown GGUF value type {value_type} for key {key!r}")

    def _skip_array(self, elem_type: int, count: int, key: str) -> None:
        if elem_type in _SCALAR_FORMATS:
            self.pos += count * struct.calcsize(self.order + _SCALAR_FORMATS[elem_type])
        elif elem_type == _STRING:
            for _ in range(count):  # strings are variable length: walk them
                self.skip_string()
        else:  # nested arrays do not occur in llama.cpp files; decode them the slow way
            sink: dict[str, int] = {}
            for _ in range(count):
                self.value(elem_type, key, sink)


# Parsed headers by (resolved path, size, mtime): `kvforge generate` read its model's header
# three times (configs, then the tensor directory), and a parse walks every vocabulary
# string (docs/benchmarks.md#kvforgemodels). A rewritten file has a new key, except within
# a timestamp's granularity (milliseconds), so a file changed in the last _SETTLED_S
# seconds is parsed anew every time.
_PARSED: dict[tuple[str, int, int], GGUFMetadata] = {}
_PARSED_MAX = 8
_PARSED_LOCK = threading.Lock()
_SETTLED_S = 2.0


def read_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """Parse the header of a GGUF (v2/v3) file: metadata fields and the tensor directory.
    The result is shared between callers, so its mappings are read-only."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no such file: {path}")
    stat = path.stat()
    if time.time() - stat.st_mtime < _SETTLED_S:
        return _read_header(path)
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    meta = _PARSED.get(key)
    if meta is None:
        meta = _read_header(path)
        with _PARSED_LOCK:  # (a server may load models from several threads)
            while len(_PARSED) >= _PARSED_MAX:
                _PARSED.pop(next(iter(_PARSED)))  # the oldest parse
            _PARSED[key] = meta
    return meta if meta.path == path else replace(meta, path=path)  # the path as this caller named it


def _read_header(path: Path) -> GGUFMetadata:
    with path.open("rb") as handle:
        if handle.read(4) != _GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return _parse_header(view, path)
            finally:
                view.release()  # must happen before the mmap closes


def _parse_header(view: memoryview, path: Path) -> GGUFMetadata:
    # The version is written in the file's byte order; a big-endian file read little-endian
    # has its low 16 bits zero (the same test GGUFReader uses).
    (version,) = struct.unpack_from("<I", view, 4)
    order = ">" if version & 0xFFFF == 0 else "<"
    cur = _Cursor(view, path, order)
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    tensor_count, kv_count = cur.unpack("Q"), cur.unpack("Q")

    fields: dict[str, Any] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key = cur.string()
        value_type = cur.unpack("I")
        value = cur.value(value_type, key, array_lengths)
        if value is not None:
            fields[key] = value

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.unpack("I")
        dims = tuple(cur.unpack("Q") for _ in range(n_dims))
        infos.append((name, dims, cur.unpack("I"), cur.unpack("Q")))

    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: general.alignment={alignment} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment  # tensor data begins at the next aligned byte
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, ggml_type, rel_offset in infos:
        if name in tensors:
            raise ModelLoadError(f"{path}: duplicate tensor {name!r}")
        tensors[name] = GGUFTensorInfo(name, dims, ggml_type, data_start + rel_offset)
    return GGUFMetadata(path, version, MappingProxyType(fields), MappingProxyType(array_lengths),
                        MappingProxyType(tensors), order)
