"""The eval layer: real KV caches and how much fp8 changes them, built on codec and io.

- :mod:`~fp8ray.eval.sample`: a synthetic KV cache with outlier key channels.
- :mod:`~fp8ray.eval.models`: the shipped model (SmolLM2-135M), loaded offline, and its cache.
- :mod:`~fp8ray.eval.capture`: capture a model's KV cache into a safetensors file.
- :mod:`~fp8ray.eval.fidelity`: error of an archive against its original, per key, layer, K/V.
- :mod:`~fp8ray.eval.eval_model`: the model's output change (KL, top-1, perplexity) per mode.
"""
