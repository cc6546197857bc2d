"""The exceptions fp8ray raises, one per failure class.

Bad arguments (an unsupported dtype, an unknown format) raise the built-in
``TypeError``/``ValueError``; the classes here mark failures of the data itself.
"""


class Fp8rayError(Exception):
    """Base class of the errors about data that fp8ray raises."""


class CorruptFrameError(Fp8rayError, ValueError):
    """A frame is truncated, malformed or fails its checksum."""


class NonFiniteError(Fp8rayError, ValueError):
    """The input holds NaN or infinity and the codec was asked to refuse it."""
