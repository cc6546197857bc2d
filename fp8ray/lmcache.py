"""fp8ray inside LMCache: the public name of :mod:`fp8ray.codec.lmcache`."""

from .codec.lmcache import *  # noqa: F401,F403
from .codec.lmcache import __all__  # noqa: F401
