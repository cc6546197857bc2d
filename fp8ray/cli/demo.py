"""``fp8ray demo``: the main job end to end on real data, on an embedded local Ray.

Captures the KV cache of the shipped model (SmolLM2-135M-Instruct, offline) over the
shipped text, or reuses the capture from an earlier run; compresses it with two
QuantWorkers; verifies the archive against the source; measures its fidelity per K/V
and layer; decompresses it; and reports sizes, error and throughput.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import Fp8rayError
from .common import codec_arguments, codec_options, positive_int, rate

SHIPPED_TEXT = Path(__file__).resolve().parents[1] / "eval" / "texts" / "lighthouse.txt"


DEMO_DIR = Path("out/demo")  # its captures are reused by later runs, and by bench lossless


def captured_cache(out_dir: Path, tokens: int | None) -> Path:
    """Where the demo keeps the shipped model's KV cache over the shipped text's first
    ``tokens`` tokens (None: all of them), which a later run reuses."""
    return out_dir / (f"kv_smollm2_{tokens}.safetensors" if tokens else "kv_smollm2.safetensors")


def add_commands(commands) -> None:
    demo = commands.add_parser("demo", help="capture a real KV cache, compress, verify, measure and decompress it on a local Ray")
    demo.add_argument("--out", type=Path, default=DEMO_DIR, help=f"working directory (default {DEMO_DIR})")
    demo.add_argument("--tokens", type=positive_int, help="tokens of the shipped text to capture (default: all, about 880)")
    codec_arguments(demo, ("fp8", "scaling", "block_size", "scale_dtype", "scale_choice"))
    demo.add_argument("--workers", type=positive_int, default=2, help="QuantWorker actors (default 2)")
    demo.set_defaults(handler=lambda args: print(run_demo(args.out, args.tokens, args.workers, codec_options(args))) or 0)


def run_demo(out_dir: Path, tokens: int | None = None, workers: int = 2, options=None) -> str:
    """Capture (or reuse), compress, verify, measure and decompress with ``options`` (a
    :class:`~fp8ray.codec.CodecOptions`; None: the default mode); return the report's lines."""
    from ..codec import CodecOptions
    from ..engine.address import check_local_size
    from ..engine.archives import compress_archive, decompress_archive, verify_archive
    from ..engine.pool import QuantPool
    from ..engine.runtime import connect_ray, disconnect_ray
    from ..eval.capture import capture
    from ..eval.fidelity import fidelity_report
    from ..eval.models import shipped_model_path
    from ..io.paths import counted, size_text

    options = options or CodecOptions()
    ray_cpus = max(workers, os.cpu_count() or 1)
    check_local_size(ray_cpus, joinable=False)  # before the capture, which takes a while

    source = captured_cache(out_dir, tokens)
    if not source.exists():
        shipped_model_path()  # the model's wheel missing: said before a folder is made for its cache
    out_dir.mkdir(parents=True, exist_ok=True)
    if source.exists():
        captured = f"reusing the captured KV cache {source} (delete it to capture again)"
    else:
        report = capture(source, SHIPPED_TEXT, tokens=tokens)
        captured = (
            f"captured {report.model}'s KV cache over {report.tokens} tokens of {SHIPPED_TEXT.name}: "
            f"{report.layers} layers x K/V of [{report.kv_heads}, {report.tokens}, {report.head_dim}] {report.dtype} -> {source}"
        )
    # A rerun replaces the last run's outputs only once its own are complete.
    archive, restored = out_dir / "kv_smollm2.fp8", out_dir / "restored.safetensors"

    owns_ray = connect_ray("local", ray_cpus)
    try:
        # Parts of 4 MiB, so that a small capture still spreads over every worker.
        with QuantPool(num_workers=workers) as pool:  # one set of workers for the three steps
            compressed = compress_archive(
                str(source), str(archive), options=options, pool=pool, part_bytes=4 << 20, overwrite=True
            )
            verified = verify_archive(str(archive), against=str(source), pool=pool)
            decompressed = decompress_archive(str(archive), str(restored), pool=pool, overwrite=True)
    finally:
        if owns_ray:
            disconnect_ray()
    if not verified.ok:
        raise Fp8rayError("verification failed: " + "; ".join(verified.errors))
    fidelity = fidelity_report(str(source), str(archive))
    k, v = fidelity.kv["k"], fidelity.kv["v"]
    mode = options.label()
    return "\n".join(
        [
            captured,
            f"compress ({mode}, {workers} QuantWorkers on {', '.join(compressed.devices)}): "
            f"{compressed.blocks} blocks, {size_text(compressed.raw_bytes)} -> {size_text(compressed.archive_bytes)} "
            f"({compressed.ratio:.2f}x) in {counted(compressed.parts, 'Parquet part')}, "
            f"{rate(compressed.input_gbps)} of input",
            f"verify against the source: {verified.blocks} blocks, every checksum ok",
            f"fidelity: keys   relative error {k['rel_fro']:.3%}, SNR {k['snr_db']:.1f} dB, cosine {k['cosine']:.6f}",
            f"          values relative error {v['rel_fro']:.3%}, SNR {v['snr_db']:.1f} dB, cosine {v['cosine']:.6f}",
            f"          worst layer: K {_worst(fidelity.layers['k'])}, V {_worst(fidelity.layers['v'])}",
            f"decompress: {decompressed.blocks} blocks -> {restored} in {decompressed.seconds:.1f} s",
            f"archive: {archive} (Parquet parts + _manifest.json; `fp8ray inspect {archive}`, "
            f"`fp8ray fidelity {source} {archive} --plot errors.png`)",
        ]
    )


def _worst(by_layer: dict[int, dict]) -> str:
    layer, metrics = max(by_layer.items(), key=lambda item: item[1]["rel_fro"])
    return f"layer {layer} at {metrics['rel_fro']:.3%}"
