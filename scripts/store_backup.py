"""An LMCache store of the shipped model's KV cache backed up to an archive and restored:
the archive's size against the store's, and the time of each step.

    .venv/bin/python scripts/store_backup.py [--requests 12] [--tokens 512] [--workers 2] [--dir DIR]

The store holds what LMCache with no serde would hold after ``--requests`` requests:
the shipped model (SmolLM2-135M) run over ``--tokens`` tokens of the shipped text, each
request starting 32 tokens after the previous one (so every request's KV differs, as
different prompts' do), cut into LMCache chunks of 256 tokens (``[2, 30, 256, 192]``
bfloat16), each a raw chunk file named as LMCache names it, in two levels of hash-prefix
folders. It is compressed into an archive in the default mode (``fp8ray compress
--lmcache-layout``), then restored as a raw store and as an ``fp8ray`` serde store
(``fp8ray decompress --lmcache-form``); each store is checked to hold the same names.
Workers run inline (no Ray: the one-shot command's fastest path, BENCHMARKS.md); times
are wall-clock of the whole call, page cache warm. The figures in BENCHMARKS.md ("LMCache
store into an archive and back") come from this script.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402

import fp8ray  # noqa: E402
from fp8ray.bench.lmcache import SHIPPED_TEXT, kv_chunks  # noqa: E402
from fp8ray.eval.capture import capture_kv  # noqa: E402
from fp8ray.eval.models import load_model, read_text, tokenize  # noqa: E402
from fp8ray.io.lmcache_store import ChunkName, format_chunk_name, hash_folders  # noqa: E402

CHUNK_TOKENS, STEP, LEVELS = 256, 32, 2


def write_store(store: Path, requests: int, tokens: int) -> None:
    """The raw store of ``requests`` requests of ``tokens`` tokens."""
    loaded = load_model(None)
    ids = tokenize(loaded, read_text(SHIPPED_TEXT), what=f"text file {SHIPPED_TEXT}")
    if tokens % CHUNK_TOKENS or (requests - 1) * STEP + tokens > ids.shape[1]:
        raise SystemExit(
            f"--tokens must be a multiple of {CHUNK_TOKENS}, and the text ({ids.shape[1]} tokens) hold every request"
        )
    for r in range(requests):
        chunks = kv_chunks(capture_kv(loaded, ids[:, r * STEP : r * STEP + tokens]), CHUNK_TOKENS)
        for c, chunk in enumerate(chunks):
            name = ChunkName(loaded.name, 0x01000100, 0, hashlib.sha256(f"{r}:{c}".encode()).digest())
            path = store / (hash_folders(name, LEVELS) + format_chunk_name(name))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(chunk.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def files(directory: Path) -> dict[str, int]:
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in directory.rglob("*") if p.is_file()}


def timed(action):
    start = time.perf_counter()
    result = action()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", help="work here and keep the store for the next run (default: a temporary directory, removed)")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="store-backup-"))
    pool = fp8ray.PoolSettings(num_workers=args.workers, address="inline")
    try:
        store = base / "store"
        if not (base / "store.done").exists():  # a --dir of an earlier run keeps its store
            shutil.rmtree(base, ignore_errors=True)
            store.mkdir(parents=True)
            write_store(store, args.requests, args.tokens)
            (base / "store.done").write_text("")
        for old in ("kv.fp8", "restored-raw", "restored-fp8ray"):
            shutil.rmtree(base / old, ignore_errors=True)
        chunks = len(files(store))
        layout = "bfloat16:2,30,256,192"
        report, compress_s = timed(
            lambda: fp8ray.compress_archive(str(store), str(base / "kv.fp8"), pool=pool, lmcache_layout=layout)
        )
        restored = {}
        for form in ("raw", "fp8ray"):
            out = base / f"restored-{form}"
            _, seconds = timed(
                lambda out=out, form=form: fp8ray.decompress_archive(str(base / "kv.fp8"), str(out), pool=pool, lmcache_form=form)
            )
            assert files(out).keys() == files(store).keys(), form
            restored[form] = (sum(files(out).values()), seconds)
        raw = sum(files(store).values())
        archive = sum(files(base / "kv.fp8").values())
        mib = 2**20
        print(f"store: {chunks} chunk files of {layout} ({args.requests} requests x {args.tokens} tokens), {raw / mib:.1f} MiB")
        print(
            f"archive (default mode, zstd:3): {archive / mib:.1f} MiB = {archive / raw:.3f} of the raw store; "
            f"compress {compress_s:.2f} s ({report.workers} inline workers)"
        )
        for form, (size, seconds) in restored.items():
            print(
                f"restore --lmcache-form {form}: {size / mib:.1f} MiB ({size / raw:.3f} of raw) in {seconds:.2f} s, "
                f"{raw / seconds / 1e9:.2f} GB/s of KV"
            )
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
