"""The io layer: where blocks come from and where frames go. No Ray, no codec decisions.

- :mod:`~fp8ray.io.paths`: local paths and URIs (``s3://``), redaction, atomic writes,
  the source/destination overlap check.
- :mod:`~fp8ray.io.safetensors`: the safetensors format, read and written (files and
  HTTP bodies share one header check).
- :mod:`~fp8ray.io.blocks`: block sources (safetensors, raw-block Parquet) and block refs.
- :mod:`~fp8ray.io.archive`: the archive format: parts, sidecars, plan, manifest.
- :mod:`~fp8ray.io.records`: the archive's records (``Manifest``, ``Plan``, ``Part``),
  read from their JSON and checked once.
- :mod:`~fp8ray.io.lmcache_store`: LMCache filesystem-store names, layouts and scanning.
"""
