"""The online service on Ray Serve: ``serve run fp8ray.serve:app`` (defaults) or
``serve run fp8ray.serve:build_app workers=4``.

- :mod:`~fp8ray.serve.requests`: what a request means, and every refusal's status (no Serve).
- :mod:`~fp8ray.serve.options`: ``ServiceOptions``, what the application is built with.
- :mod:`~fp8ray.serve.deployment`: ``Fp8Service`` and ``build_app``.
"""

from .deployment import Fp8Service, build_app
from .options import ServiceOptions

app = build_app()

__all__ = ["Fp8Service", "ServiceOptions", "app", "build_app"]
