"""How LMCache is installed beside fp8ray: its pure-Python modules that the serde code
imports come with fp8ray's ``lmcache`` extra; LMCache itself goes in with ``--no-deps``,
since its other dependencies are CUDA libraries (cupy, cufile, nvtx) and clients of
services this code never imports (scripts/setup runs the same two commands)."""

LMCACHE_VERSION = "0.5.6"
INSTALL_COMMAND = f"pip install 'fp8ray[lmcache]' && pip install --no-deps lmcache=={LMCACHE_VERSION}"
