"""The engine layer: Ray. ``QuantWorker`` actors run every job on shards of blocks;
``QuantPool`` schedules them; the archive and LMCache-store operations are built on both.

- :mod:`~fp8ray.engine.address`: which Ray a pool given no address uses (or none: inline).
- :mod:`~fp8ray.engine.runtime`: joining Ray or starting an embedded one.
- :mod:`~fp8ray.engine.worker`: ``QuantWorker`` and the dataclasses its methods return.
- :mod:`~fp8ray.engine.pool`: ``QuantPool``, the driver-side scheduler.
- :mod:`~fp8ray.engine.archives`: compress, decompress, verify and inspect archives.
- :mod:`~fp8ray.engine.stores`: convert LMCache filesystem stores.
"""
