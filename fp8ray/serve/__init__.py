"""The online service on Ray Serve: ``serve run fp8ray.serve:app`` (defaults) or
``serve run fp8ray.serve:build_app workers=4``.

- :mod:`~fp8ray.serve.requests`: what a request means, and every refusal's status (no Serve).
- :mod:`~fp8ray.serve.options`: ``ServiceOptions``, what the application is built with.
- :mod:`~fp8ray.serve.archives`: which archives the block route reads, and the open readers (no Serve).
- :mod:`~fp8ray.serve.stats`: the counters each replica keeps, summed on read (no Serve).
- :mod:`~fp8ray.serve.environment`: the Serve settings ``fp8ray serve`` starts Ray with.
- :mod:`~fp8ray.serve.deployment`: ``Fp8Service`` and ``build_app``.

Ray Serve is imported on first use of ``app``, ``build_app`` or ``Fp8Service``, so that
the request parsing loads (and is tested) without it.
"""

from .options import ServiceOptions

_DEPLOYMENT = ("Fp8Service", "build_app")


def __getattr__(name: str):
    if name in _DEPLOYMENT or name == "app":
        from . import deployment

        if name == "app":
            globals()["app"] = deployment.build_app()  # built once, with the defaults
            return globals()["app"]
        return getattr(deployment, name)
    raise AttributeError(f"module 'fp8ray.serve' has no attribute {name!r}")


__all__ = ["Fp8Service", "ServiceOptions", "app", "build_app"]
