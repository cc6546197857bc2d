"""Helpers shared by the tests: reference comparisons and the derived error bound."""

from __future__ import annotations

import ctypes
import errno
import json
import socket
from contextlib import ExitStack, contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from fp8ray.codec.bound import bound_constants, element_bound, element_scales  # noqa: F401 (re-exported)
from fp8ray.codec.formats import FORMATS
from fp8ray.io import archive

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALINGS = ("none", "tensor", "channel", "token", "block")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``fp8ray ARGV...`` in this process (each argument as its string): exit code, stdout, stderr."""
    from fp8ray.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def random_bits(dtype: str, shape=(3, 5), seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` (torch's name) holding random bytes: any bit pattern (NaN,
    inf and negative zero of the floats among them), a bool's byte 0 or 1."""
    t = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * t.itemsize,), dtype=torch.uint8, generator=g)
    return (raw & 1 if dtype == "bool" else raw).view(t).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw little-endian bytes, whatever its dtype (0-d included)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a tensor, for bit-exact comparison."""
    t = t.contiguous().reshape(-1)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(view).numpy()


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical, except that any two NaNs count as equal (payloads are not a contract)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = bits(actual), bits(expected)
    nan = torch.isnan(actual.float()).reshape(-1).numpy() & torch.isnan(expected.float()).reshape(-1).numpy()
    mismatch = np.flatnonzero((a != e) & ~nan)
    assert mismatch.size == 0, (
        f"{mismatch.size} elements differ, first at {mismatch[0]}: {a[mismatch[0]]:#x} vs {e[mismatch[0]]:#x}"
    )


def error_bound(x: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """Per-element bound on |deq - x| derived in docs/ACCURACY.md: the codec's own
    (fp8ray.codec.bound), the one verify holds archives to."""
    return element_bound(x, deq, scale, bound_constants(FORMATS[fmt_name], "tensor"))


def kv_like(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Random data of many magnitudes: log-uniform over 2^-20..2^12 per channel, random signs."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.empty(shape).uniform_(-20, 12, generator=g)) if len(shape) else torch.tensor(1.5)
    signs = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (mags * signs).to(dtype)


def quant_worker_pids() -> list[int]:
    """PIDs of the QuantWorkers of this test session's Ray: descendants of this process
    (the embedded Ray's raylet is our child), never another Ray's on the machine."""
    import os

    import psutil

    def cmdline(p) -> list[str]:
        try:
            return p.cmdline()
        except psutil.Error:
            return []

    return sorted(
        p.pid
        for p in psutil.Process(os.getpid()).children(recursive=True)
        if (cmdline(p) or [""])[0].startswith("ray::QuantWorker")
    )


def wait_for_lmcache_fd(fd: int) -> None:
    """Wait (2 minutes at most) for LMCache's adapter to signal completion on its event fd, then consume it."""
    import select

    from lmcache.v1.platform import consume_fd

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(120_000), "LMCache's adapter did not signal completion"
    consume_fd(fd)


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback TCP ports nothing listens on now. Each is held open
    until all are chosen: a port closed and asked for again can come back, and ``ray
    start`` given one port twice fails (it did in CI, client server and agent on one)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    return free_ports(1)[0]


@contextmanager
def moto_s3(bucket: str):
    """A moto S3 server on a free loopback port holding ``bucket``; yields a function of a
    key that gives its s3:// URI (credentials and endpoint in the URI, so Ray workers
    need no env)."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        admin = pafs.S3FileSystem(
            access_key="testing",
            secret_key="testing",
            endpoint_override=f"127.0.0.1:{port}",
            scheme="http",
            region="us-east-1",
            allow_bucket_creation=True,
        )
        admin.create_dir(bucket)
        yield lambda key: f"s3://testing:testing@{bucket}/{key}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    finally:
        server.stop()


def processes_with_ray_tmp(ray_tmp: str) -> list:
    """The processes started with this ``RAY_TMPDIR`` (a Ray's, which inherit it)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("RAY_TMPDIR") == ray_tmp:
                found.append(p)
        except psutil.Error:
            pass
    return found


def failing_fallocate(code: int):
    """A stand-in for libc's ``fallocate`` (``fp8ray.io.safetensors._fallocate``) that
    fails with errno ``code``, as ctypes reports it."""

    def fallocate(fd, mode, offset, length):
        ctypes.set_errno(code)
        return -1

    return fallocate


class InterruptedAfter:
    """A local filesystem whose ``method`` does its work and is then interrupted, as a
    Ctrl-C that arrives during the call is raised as it returns."""

    def __init__(self, method: str):
        self.fs, self.method = pafs.LocalFileSystem(), method

    def __getattr__(self, name):
        attr = getattr(self.fs, name)
        if name != self.method:
            return attr

        def then_interrupt(*args, **kwargs):
            attr(*args, **kwargs)
            raise KeyboardInterrupt

        return then_interrupt


def interrupted_main(args: list[str], delay: float) -> tuple[int, str, float]:
    """``fp8ray.cli.main(args)`` in this process with SIGINT sent to it ``delay`` seconds
    in, unless it has returned by then (the caller holds a SIGINT handler of its own for
    one that comes as it returns): its exit code, its stderr, and how long it ran past the
    moment the signal was due (negative: it finished first). Shared by
    tests/cli/test_interrupts.py and scripts/interrupt_sweep.py."""
    import io
    import os
    import signal
    import threading
    import time

    from fp8ray.cli import main

    lock, running = threading.Lock(), [True]

    def interrupt():
        with lock:
            if running[0]:
                os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(delay, interrupt)
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        timer.start()
        sent = time.monotonic()
        try:
            code = main(args)
        finally:
            with lock:
                running[0] = False
            timer.cancel()
        took = time.monotonic() - sent - delay
    time.sleep(0.05)  # a signal still pending lands on the caller's handler
    return code, err.getvalue(), took


def no_space(*_args, **_kwargs):
    """A stand-in for any write that fails as a full disk does, in pyarrow's words."""
    raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")


def rewrite_column(path: Path, column: str, values: list) -> archive.Part:
    """The part rewritten, as fp8ray writes parts, with ``column`` holding ``values``:
    valid Parquet whose footer matches its bytes; returns its entry."""
    table = pq.read_table(path)
    rows = table.set_column(table.schema.get_field_index(column), column, pa.array(values, table.schema.field(column).type))
    index = int(path.name[len("part-") : -len(".parquet")])
    return archive.write_part(pafs.LocalFileSystem(), str(path.parent), index, rows.to_pydict())


def record_entry(arch: Path, entry: archive.Part, *fields: str) -> None:
    """Record these fields of a part's entry in the manifest, as if the damage matched them."""
    path = arch / archive.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    (written,) = [e for e in manifest["parts"] if e["name"] == entry.name]
    written.update({name: getattr(entry, name) for name in fields})
    for total, of_part in (("blocks", "blocks"), ("raw_bytes", "raw_bytes"), ("frame_bytes", "frame_bytes")):
        manifest[total] = sum(e[of_part] for e in manifest["parts"])  # the totals follow their parts
    manifest["archive_bytes"] = sum(e["file_bytes"] for e in manifest["parts"])
    path.write_text(json.dumps(manifest))
