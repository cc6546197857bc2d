"""A read-only local filesystem that counts the bytes read through it: what reading one
block of an archive costs in storage reads (``scripts/block_read.py``, the reader's tests).
Pass it as ``filesystem=`` where fp8ray takes a ``pyarrow.fs`` filesystem."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.fs as pafs


class _Counting(io.RawIOBase):
    """A file whose reads are added up in ``counter``."""

    def __init__(self, inner: pa.NativeFile, counter: list[int]):
        self.inner, self.counter = inner, counter

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def readinto(self, buffer) -> int:
        data = self.inner.read(len(buffer))
        buffer[: len(data)] = data
        self.counter[0] += len(data)
        return len(data)

    def close(self) -> None:
        self.inner.close()
        super().close()


class CountingHandler(pafs.FileSystemHandler):
    """The local filesystem, read-only, adding up the bytes read through it in ``read[0]``."""

    def __init__(self):
        self.fs, self.read = pafs.LocalFileSystem(), [0]

    def get_type_name(self):
        return "counting"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def open_input_file(self, path):
        return pa.PythonFile(_Counting(self.fs.open_input_file(path), self.read), mode="r")

    def open_input_stream(self, path):
        return self.open_input_file(path)

    def _read_only(self, *args):
        raise OSError("read only")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _read_only
    move = copy_file = open_output_stream = open_append_stream = _read_only
