"""The GGUF binary format (llama.cpp's; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): the
header, the metadata and the tensor directory of a file mapped read-only.

The metadata is walked with ``struct`` here, not read through transformers: its
``load_gguf_checkpoint(path)`` walks the vocabulary arrays (49k entries in SmolLM2) through
``gguf.GGUFReader``, many times slower than this walk, and the format is simple and stable.
transformers 5.24's ``integrations.gguf.read_gguf_metadata`` is as fast, but the models extra still accepts
transformers 4.46, which has only the slow path. Tensor data is not read here: a ``GGUFTensorInfo``
gives its type, shape and bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.model.weights import ModelLoadError

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.md): id -> struct format of a scalar. 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), i.e. GGUF's dims reversed
    ggml_type: int
    offset: int  # absolute offset of the data in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path} is truncated: metadata runs past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path} is truncated: a string runs past the end of the file")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelLoadError(f"{self.path}: a metadata string at byte {self.pos - n} is not UTF-8") from None

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.unpack("I")
            count = self.unpack("Q")
            if item_type in _NUMPY_TYPES:
                dtype = np.dtype(_NUMPY_TYPES[item_type])
                if self.pos + count * dtype.itemsize > len(self.buf):
                    raise ModelLoadError(f"{self.path} is truncated: an array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos += count * dtype.itemsize
                return arr
            return [self.value(item_type) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


def read_gguf(path: Path, buf: mmap.mmap) -> GGUFFile:
    """Parse the header, metadata and tensor directory of a GGUF file held in ``buf``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if buf[:4] != _GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (its first bytes are {bytes(buf[:4])!r}, not b'GGUF')")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise ModelLoadError(f"{path}: GGUF version {version}{hint} is not supported; supported: 2, 3")
    n_tensors = cur.unpack("Q")
    n_kv = cur.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        dims = [cur.unpack("Q") for _ in range(n_dims)]
        ggml_type = cur.unpack("I")
        offset = cur.unpack("Q")
        infos.append((name, dims, ggml_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, ggml_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from None
        numel = int(np.prod(dims)) if dims else 1
        nbytes = numel // block * type_size
        start = data_start + offset
        if start + nbytes > len(buf):
            raise ModelLoadError(f"{path} is truncated: tensor {name} runs past the end of the file")
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)
    return GGUFFile(path, version, metadata, tensors)


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap]:
    """The file mapped read-only, closed on the way out."""
    if not path.is_file():
        raise ModelLoadError(f"no such GGUF file: {path}")
    with path.open("rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise ModelLoadError(f"{path} is empty, not a GGUF file") from None
    try:
        yield buf
    finally:
        # If an exception's traceback still holds a numpy view of the mapping, closing fails; the
        # mapping is then released with that view.
        with contextlib.suppress(BufferError):
            buf.close()
