"""Benchmarks, each printing its figures beside a baseline measured in the same run:
``fp8ray bench codec`` (:mod:`~fp8ray.bench.codec`), ``bench pipeline``
(:mod:`~fp8ray.bench.pipeline`), ``bench serve`` (:mod:`~fp8ray.bench.serve`), ``bench
startup`` (:mod:`~fp8ray.bench.startup`)."""
