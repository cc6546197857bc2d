"""``fp8ray.serve``: the online encode/decode service on Ray Serve.

``Fp8Service`` is a FastAPI-ingress deployment. Its replicas hold no codec: they parse
and check requests, then await calls on a pool of ``QuantWorker`` actors, the same actor
class the batch jobs use. The pool is made of Serve *deployment-scoped actors*: created
once by the Serve controller, shared by every replica, health-checked and recreated by
the controller, and removed with the application. A replica that finds its handle to a
worker dead looks the worker up again and retries the request once on another worker;
if that fails too it answers 503, never wrong data.

Run it with ``fp8ray serve``, ``serve run fp8ray.serve:app`` or ``serve deploy
serve_config.yaml``; the builder :func:`build_app` takes the pool size and limits.

HTTP API (see README): ``POST /v1/encode``, ``POST /v1/decode`` (raw tensor or frame
bodies, or ``application/x-safetensors`` bodies of many blocks), ``GET /healthz``,
``GET /v1/stats``. Python: ``handle.encode.remote(tensor, **codec_options)`` answers the
frame's bytes, ``handle.decode.remote(frame)`` the tensor.
"""

# No `from __future__ import annotations`: FastAPI must see the real Request type in the
# routes' signatures, which Serve's ingress rewrites.
import asyncio
import inspect
import itertools
import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.serve.config import DeploymentActorConfig
from ray.util import metrics

from .bodies import BodyError, build_safetensors, parse_safetensors
from .codec import Fp8Codec
from .sources import TORCH_DTYPES, TORCH_NAMES, bytes_to_tensor, tensor_to_bytes
from .worker import BlockError, QuantWorker

OCTET_STREAM = "application/octet-stream"
SAFETENSORS = "application/x-safetensors"
WORKER_PREFIX = "quant-worker-"
STATS_ACTOR = "service-stats"
HEALTH_TIMEOUT_S = 10.0
# Codec options a request may set: the Fp8Codec constructor's, less the non-finite policy
# (a service never stores NaN silently).
CODEC_OPTIONS = tuple(p for p in inspect.signature(Fp8Codec).parameters if p != "nonfinite")


@dataclass(frozen=True)
class ServiceOptions:
    """What :func:`build_app` takes (as a dict, from ``serve run`` arguments or a config)."""

    workers: int = 2
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    replicas: int = 0  # 0: Serve's default, or what a config file sets (autoscaling)
    max_body_mb: float = 256.0  # larger bodies are answered 413

    @classmethod
    def from_args(cls, args: dict | None) -> "ServiceOptions":
        args = dict(args or {})
        unknown = set(args) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown fp8ray.serve option(s) {sorted(unknown)}; expected {sorted(cls.__dataclass_fields__)}")
        try:
            options = cls(**{k: type(getattr(cls, k))(v) for k, v in args.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad fp8ray.serve option: {exc}") from exc
        if options.workers < 1 or options.replicas < 0 or options.cpus_per_worker <= 0 or options.gpus_per_worker < 0 or options.max_body_mb <= 0:
            raise ValueError(f"fp8ray.serve options out of range: {options}")
        return options


class ServiceStats:
    """Counters shared by every replica (a deployment-scoped actor): requests, bytes in
    and out, errors. Replicas report without waiting; a lost report only undercounts."""

    def __init__(self):
        self.counts = {"requests": 0, "bytes_in": 0, "bytes_out": 0, "errors": 0, "retries": 0}

    def record(self, **deltas: int) -> None:
        for name, value in deltas.items():
            self.counts[name] += value

    def snapshot(self) -> dict:
        return dict(self.counts)


class Problem(ValueError):
    """Bad input, answered with an error status and a JSON body naming the field (and
    raised as a ValueError to callers of the Python handle)."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field


class WorkersUnavailable(RuntimeError):
    """No QuantWorker answered a request, even after the one retry."""


def _problem_response(exc: Problem) -> JSONResponse:
    body = {"error": str(exc), "status": exc.status}
    if exc.field:
        body["field"] = exc.field
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return JSONResponse(body, status_code=exc.status, headers=headers)


def parse_codec_options(params: dict[str, str], ignore: tuple[str, ...] = ()) -> dict:
    """Codec options from query parameters, each checked, then checked together; an
    unknown or bad one raises :class:`Problem` 400 naming it."""
    options: dict = {}
    for name, text in params.items():
        if name in ignore:
            continue
        if name not in CODEC_OPTIONS:
            raise Problem(400, f"unknown option {name!r}; expected one of {sorted((*CODEC_OPTIONS, *ignore))}", field=name)
        value = int(text) if text.isdigit() else text
        try:
            # The codec's own checks, one option at a time; scale_choice is checked on
            # token scaling here, as it may need one that comes in another parameter.
            Fp8Codec(**{name: value, **({"scaling": "token"} if name == "scale_choice" else {})})
        except (TypeError, ValueError) as exc:
            raise Problem(400, f"{name}: {exc}", field=name) from None
        options[name] = value
    try:
        Fp8Codec(**options)  # together: scale_choice=mse needs token or block scaling
    except (TypeError, ValueError) as exc:
        raise Problem(400, str(exc), field="scale_choice" if "scale_choice" in options else next(iter(options))) from None
    return options


def parse_layout(dtype: str | None, shape: str | None, body_bytes: int) -> tuple[str, tuple[int, ...]]:
    """The dtype and shape query parameters of a raw encode, checked against the body."""
    if dtype is None:
        raise Problem(400, f"dtype is required; one of {sorted(TORCH_DTYPES)}", field="dtype")
    if dtype.removeprefix("torch.") not in TORCH_DTYPES:
        raise Problem(400, f"unknown dtype {dtype!r}; expected one of {sorted(TORCH_DTYPES)}", field="dtype")
    dtype = dtype.removeprefix("torch.")
    if shape is None:
        raise Problem(400, "shape is required, as comma-separated sizes such as 2,30,256,192", field="shape")
    try:
        dims = tuple(int(d) for d in shape.split(",")) if shape.strip() else ()
    except ValueError:
        raise Problem(400, f"shape {shape!r} is not comma-separated integers", field="shape") from None
    if any(d < 0 for d in dims):
        raise Problem(400, f"shape {shape!r} has a negative size", field="shape")
    expected = math.prod(dims) * TORCH_DTYPES[dtype].itemsize
    if expected != body_bytes:
        raise Problem(400, f"shape {list(dims)} of {dtype} needs {expected} bytes but the body has {body_bytes}", field="shape")
    return dtype, dims


def _split(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous groups of near-equal count (order kept)."""
    if not items:
        raise Problem(400, "the safetensors body holds no tensors", field="body")
    parts = max(1, min(parts, len(items)))
    size = -(-len(items) // parts)
    return [items[i : i + size] for i in range(0, len(items), size)]


def _is_safetensors(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() == SAFETENSORS


# Everything Fp8Service uses is defined above it: Serve serializes the class when it is
# decorated, with the module globals that exist by then.
logger = logging.getLogger("ray.serve")
api = FastAPI(title="fp8ray", description="fp8 encode/decode of LLM KV-cache blocks")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
@serve.ingress(api)
class Fp8Service:
    """The ingress replica: request checks, then awaited calls on the shared QuantWorkers."""

    def __init__(self, num_workers: int, max_body_bytes: int):
        self.num_workers = num_workers
        self.max_body_bytes = max_body_bytes
        self._handles: dict[int, object] = {}
        self._next = itertools.count()
        tags = ("route", "status")
        self._requests = metrics.Counter("fp8ray_serve_requests", "HTTP requests answered", tag_keys=tags)
        self._errors = metrics.Counter("fp8ray_serve_errors", "HTTP requests answered with an error status", tag_keys=tags)
        self._bytes = metrics.Counter("fp8ray_serve_bytes", "Body bytes received (in) and sent (out)", tag_keys=("route", "direction"))
        self._latency = metrics.Histogram(
            "fp8ray_serve_latency_seconds", "Request latency in seconds",
            boundaries=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10], tag_keys=("route",),
        )
        self._stats = None

    # --- the worker pool -------------------------------------------------------------

    def _worker(self, index: int):
        if index not in self._handles:
            try:
                self._handles[index] = serve.get_deployment_actor(f"{WORKER_PREFIX}{index}")
            except ValueError:  # being recreated by the controller
                return None
        return self._handles[index]

    async def _call(self, method: str, *args):
        """``QuantWorker.<method>(*args)`` on the next worker; if that worker is dead, once
        more on another. Data errors come back as :class:`BlockError`."""
        first = next(self._next) % self.num_workers
        order = [first] + ([(first + 1) % self.num_workers] if self.num_workers > 1 else [first])
        for attempt, index in enumerate(order):
            handle = self._worker(index)
            if handle is None:
                continue
            try:
                return await getattr(handle, method).remote(*args)
            except (RayActorError, ActorUnavailableError):
                self._handles.pop(index, None)  # look it up again next time
                if attempt == 0:
                    self._record(retries=1)
            except RayTaskError as exc:
                # The worker raises BlockError, a ValueError, for bad data. Test the builtin
                # base: the cause's class can arrive here as a copy of fp8ray's.
                if isinstance(exc, ValueError):
                    raise BlockError(str(exc.cause)) from None
                raise
        raise WorkersUnavailable(f"no QuantWorker answered {method} (tried workers {sorted(set(order))})")

    async def _map(self, method: str, items: list, *extra) -> list:
        """Spread ``items`` over the workers in contiguous groups; results in order."""
        groups = _split(items, self.num_workers)
        results = await asyncio.gather(*(self._call(method, group, *extra) for group in groups))
        return [r for group in results for r in group]

    def _record(self, **deltas: int) -> None:
        if self._stats is None:
            try:
                self._stats = serve.get_deployment_actor(STATS_ACTOR)
            except ValueError:
                return
        self._stats.record.remote(**deltas)  # not awaited: counters never slow a request

    # --- HTTP --------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to be over the limit."""
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise Problem(400, f"Content-Length {declared!r} is not a number", field="Content-Length")
            if int(declared) > self.max_body_bytes:
                raise Problem(413, f"body of {declared} bytes exceeds the limit of {self.max_body_bytes}", field="body")
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > self.max_body_bytes:
                raise Problem(413, f"body exceeds the limit of {self.max_body_bytes} bytes", field="body")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _answer(self, route: str, request: Request, handler) -> Response:
        start = time.perf_counter()
        bytes_in = 0
        try:
            body = await self._read_body(request) if request.method == "POST" else b""
            bytes_in = len(body)
            response = await handler(request, body)
        except Problem as exc:
            response = _problem_response(exc)
        except BodyError as exc:
            response = _problem_response(Problem(400, str(exc), exc.field))
        except BlockError as exc:
            response = _problem_response(Problem(422, str(exc), "body"))
        except WorkersUnavailable as exc:
            response = _problem_response(Problem(503, str(exc)))
        except Exception as exc:  # a bug: answer 500 with its name, and log it
            logger.exception("%s %s failed", request.method, route)
            response = _problem_response(Problem(500, f"internal error: {type(exc).__name__}: {exc}"))
        status = str(response.status_code)
        bytes_out = len(response.body)
        self._requests.inc(tags={"route": route, "status": status})
        if response.status_code >= 400:
            self._errors.inc(tags={"route": route, "status": status})
        for direction, count in (("in", bytes_in), ("out", bytes_out)):
            if count:  # a Counter takes only positive increments
                self._bytes.inc(count, tags={"route": route, "direction": direction})
        self._latency.observe(time.perf_counter() - start, tags={"route": route})
        self._record(requests=1, bytes_in=bytes_in, bytes_out=bytes_out, errors=int(response.status_code >= 400))
        return response

    @api.post("/v1/encode")
    async def http_encode(self, request: Request) -> Response:
        return await self._answer("/v1/encode", request, self._encode_body)

    @api.post("/v1/decode")
    async def http_decode(self, request: Request) -> Response:
        return await self._answer("/v1/decode", request, self._decode_body)

    @api.get("/healthz")
    async def http_healthz(self, request: Request) -> Response:
        return await self._answer("/healthz", request, self._health)

    @api.get("/v1/stats")
    async def http_stats(self, request: Request) -> Response:
        return await self._answer("/v1/stats", request, self._stats_body)

    async def _encode_body(self, request: Request, body: bytes) -> Response:
        params = dict(request.query_params)
        if _is_safetensors(request):
            for name in ("dtype", "shape"):
                if name in params:
                    raise Problem(400, f"{name} comes from the safetensors header, not the query", field=name)
            options = parse_codec_options(params)
            entries, _ = parse_safetensors(body, ("BF16", "F16", "F32"))
            results = await self._map("encode_batch", [(k, d, s, data) for k, d, s, data in entries], options)
            frames = [(meta["key"], "uint8", (len(f),), f) for f, meta in results]
            return Response(build_safetensors(frames, {"fp8ray": "frames"}), media_type=SAFETENSORS)
        options = parse_codec_options(params, ignore=("dtype", "shape"))
        dtype, shape = parse_layout(params.get("dtype"), params.get("shape"), len(body))
        [(f, meta)] = await self._call("encode_batch", [("body", dtype, shape, np.frombuffer(body, dtype=np.uint8))], options)
        return Response(f.tobytes(), media_type=OCTET_STREAM, headers={"X-Fp8ray-Device": meta["device"]})

    async def _decode_body(self, request: Request, body: bytes) -> Response:
        if request.query_params:
            name = next(iter(request.query_params))
            raise Problem(400, f"unknown option {name!r}: a frame describes itself", field=name)
        if _is_safetensors(request):
            entries, _ = parse_safetensors(body, ("U8",))
            results = await self._map("decode_batch", [(k, data) for k, _, _, data in entries])
            tensors = [(meta["key"], meta["dtype"], tuple(meta["shape"]), raw) for raw, meta in results]
            return Response(build_safetensors(tensors), media_type=SAFETENSORS)
        [(raw, meta)] = await self._call("decode_batch", [("body", np.frombuffer(body, dtype=np.uint8))])
        headers = {"X-Fp8ray-Dtype": meta["dtype"], "X-Fp8ray-Shape": ",".join(map(str, meta["shape"])), "X-Fp8ray-Device": meta["device"]}
        return Response(raw.tobytes(), media_type=OCTET_STREAM, headers=headers)

    async def _alive_workers(self) -> int:
        async def ping(index: int) -> bool:
            handle = self._worker(index)
            if handle is None:
                return False
            try:
                await asyncio.wait_for(handle.info.remote(), HEALTH_TIMEOUT_S)
                return True
            except (RayActorError, ActorUnavailableError, GetTimeoutError, asyncio.TimeoutError):
                self._handles.pop(index, None)
                return False

        return sum(await asyncio.gather(*(ping(i) for i in range(self.num_workers))))

    async def _health(self, request: Request, body: bytes) -> Response:
        alive = await self._alive_workers()
        if not alive:
            raise Problem(503, f"none of the {self.num_workers} QuantWorkers answers")
        return JSONResponse({"status": "ok", "workers_alive": alive, "workers": self.num_workers})

    async def _stats_body(self, request: Request, body: bytes) -> Response:
        try:
            counts = await serve.get_deployment_actor(STATS_ACTOR).snapshot.remote()
        except (ValueError, RayActorError, ActorUnavailableError):  # being recreated
            self._stats = None  # and this replica's handle to it with it
            raise Problem(503, "the stats actor is restarting") from None
        return JSONResponse({**counts, "workers": self.num_workers, "workers_alive": await self._alive_workers()})

    # --- Python handle API -------------------------------------------------------------

    async def encode(self, tensor, **codec_options) -> bytes:
        """Encode a tensor (or a float16/float32 ndarray); returns the frame's bytes."""
        if isinstance(tensor, np.ndarray):
            tensor = torch.from_numpy(tensor)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in TORCH_NAMES:
            raise TypeError(f"expected a bfloat16/float16/float32 tensor or array, got {getattr(tensor, 'dtype', type(tensor).__name__)}")
        options = parse_codec_options({k: str(v) for k, v in codec_options.items()})
        block = ("tensor", TORCH_NAMES[tensor.dtype], tuple(tensor.shape), tensor_to_bytes(tensor.detach().cpu()))
        [(f, _)] = await self._call("encode_batch", [block], options)
        return f.tobytes()

    async def decode(self, frame) -> torch.Tensor:
        """Decode a frame (bytes, memoryview or uint8 array); returns the tensor."""
        [(raw, meta)] = await self._call("decode_batch", [("frame", np.frombuffer(frame, dtype=np.uint8))])
        return bytes_to_tensor(raw, meta["dtype"], meta["shape"]).clone()  # owns its memory


def build_app(args: dict | None = None) -> serve.Application:
    """The application: ``Fp8Service`` replicas and their shared ``QuantWorker`` pool.
    ``args`` are :class:`ServiceOptions` fields (strings allowed, as from ``serve run``)."""
    options = ServiceOptions.from_args(args)
    worker_class = ray.remote(QuantWorker)
    actors = [
        DeploymentActorConfig(
            name=f"{WORKER_PREFIX}{i}",
            actor_class=worker_class,
            init_kwargs={"threads": max(1, int(options.cpus_per_worker))},
            actor_options={"num_cpus": options.cpus_per_worker, "num_gpus": options.gpus_per_worker},
        )
        for i in range(options.workers)
    ]
    actors.append(DeploymentActorConfig(name=STATS_ACTOR, actor_class=ray.remote(ServiceStats), actor_options={"num_cpus": 0}))
    deployment = Fp8Service.options(deployment_actors=actors)
    if options.replicas:
        deployment = deployment.options(num_replicas=options.replicas)
    return deployment.bind(
        options.workers, int(options.max_body_mb * 2**20)
    )


# `serve run fp8ray.serve:app` (defaults) or `serve run fp8ray.serve:build_app workers=4`.
app = build_app()
