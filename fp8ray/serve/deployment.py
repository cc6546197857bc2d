"""``Fp8Service``, the Ray Serve deployment of the online encode/decode service.

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
``GET /v1/stats``, and, for a service started with an archives root,
``GET /v1/archive/block?archive=...&key=...&file=...`` (one block of an archive under
the root, as a safetensors body; read and decoded in the replica, see
:meth:`Fp8Service._block_body`). Python: ``handle.encode.remote(tensor, **codec_options)``
answers the frame's bytes, ``handle.decode.remote(frame)`` the tensor.
"""

# No `from __future__ import annotations`: FastAPI must see the real Request type in the
# routes' signatures, which Serve's ingress rewrites.
import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError, TaskCancelledError
from ray.serve.config import DeploymentActorConfig
from ray.util import metrics
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..codec.blocks import Block, bytes_to_tensor, frame_sizes
from ..codec.fp8codec import Fp8Codec, source_tensor
from ..engine.backends import worker_exception
from ..engine.worker import QuantWorker
from ..errors import BadInputError, CorruptDataError, RequestError, WorkersUnavailableError
from ..io.safetensors import FRAME_DTYPE, FRAMES_BODY, FRAMES_MARK, SOURCE_DTYPES, build_body, header_prefix, parse_body
from .archives import ArchiveRoot
from .options import ServiceOptions
from .requests import (
    OCTET_STREAM,
    SAFETENSORS,
    codec_options,
    is_safetensors,
    raw_layout,
    refusal,
    response_limit,
    single_params,
    split,
    unknown_name,
)
from .stats import REPORT_INTERVAL_S, ReplicaCounts, ServiceStats

WORKER_PREFIX = "quant-worker-"
STATS_ACTOR = "service-stats"
HEALTH_TIMEOUT_S = 10.0
BLOCK_PARAMS = ("archive", "key", "file")  # the query of GET /v1/archive/block
CLIENT_CLOSED = 499  # the status recorded for a request whose client hung up (nginx's)
# How long a stop waits for the requests in flight to finish (new ones are answered 503
# meanwhile): as long as the default body timeout, by which a stalled upload is answered.
DRAIN_S = ServiceOptions.body_timeout_s
BATCH_BLOCKS = 16  # raw requests answered by one round of QuantWorker calls, at most
# Raw bodies larger than this go to a QuantWorker alone: a batch of them would hold
# BATCH_BLOCKS bodies' results in one worker, and small requests would wait behind them.
BATCH_BODY_BYTES = 2 << 20


def _answer_of(answer):
    """A batched request's own answer, or the exception it raised, raised here."""
    if isinstance(answer, BaseException):
        try:
            raise answer
        finally:  # the traceback holds this frame: a cycle through it would keep the body until a GC
            del answer
    return answer


def _refusal_response(status: int, message: str, field: str | None) -> JSONResponse:
    body = {"error": message, "status": status}
    if field:
        body["field"] = field
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


# Everything Fp8Service uses is defined above it: Serve serializes the class when it is
# decorated, with the module globals that exist by then.
logger = logging.getLogger("ray.serve")
api = FastAPI(title="fp8ray", description="fp8 encode/decode of LLM KV-cache blocks")


@api.exception_handler(StarletteHTTPException)
async def _routing_refusal(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """An unknown path (404) or method (405), answered in the service's JSON as every
    other refusal (FastAPI's own is ``{"detail": ...}``), its headers (``Allow``) kept."""
    response = _refusal_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", None)
    response.headers.update(exc.headers or {})
    return response


# No access-log line per request (Serve's default writes one to the replica's log):
# the Prometheus metrics and /v1/stats count requests, and a line costs each request.
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64, logging_config={"enable_access_log": False})
@serve.ingress(api)
class Fp8Service:
    """The ingress replica: request checks, then awaited calls on the shared QuantWorkers."""

    def __init__(
        self, num_workers: int, max_body_bytes: int, archives: str = "", body_timeout_s: float = ServiceOptions.body_timeout_s
    ):
        self.num_workers = num_workers
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self._archives_root = archives
        self._archives = ArchiveRoot(archives) if archives else None  # GET /v1/archive/block reads under it
        self._handles: dict[int, object] = {}
        self._next = itertools.count()
        tags = ("route", "status")
        self._requests = metrics.Counter("fp8ray_serve_requests", "HTTP requests answered", tag_keys=tags)
        self._errors = metrics.Counter("fp8ray_serve_errors", "HTTP requests answered with an error status", tag_keys=tags)
        self._bytes = metrics.Counter(
            "fp8ray_serve_bytes", "Body bytes received (in) and sent (out)", tag_keys=("route", "direction")
        )
        self._latency = metrics.Histogram(
            "fp8ray_serve_latency_seconds",
            "Request latency in seconds",
            boundaries=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
            tag_keys=("route",),
        )
        self._stats = None  # the stats actor's handle, looked up when first reported to
        self._counts = ReplicaCounts()
        self._reporter: asyncio.Task | None = None
        self._in_flight = 0  # HTTP requests and handle calls being answered
        self._draining = False  # the service is stopping: new requests are answered 503
        try:  # reporting from the start, so that an idle replica too hears of a stop
            self._start_reporting()
        except RuntimeError:  # no event loop here: started by the first request
            pass

    # --- the worker pool -------------------------------------------------------------

    def _worker(self, index: int):
        if index not in self._handles:
            try:
                self._handles[index] = serve.get_deployment_actor(f"{WORKER_PREFIX}{index}")
            except ValueError:  # being recreated by the controller
                return None
        return self._handles[index]

    async def _call(self, method: Callable, *args):
        """``method(*args)`` (a ``QuantWorker`` method) on the next worker; if that worker is
        dead, once more on another. Data errors come back as the worker raised them."""
        first = next(self._next) % self.num_workers
        order = [first] + ([(first + 1) % self.num_workers] if self.num_workers > 1 else [first])
        for attempt, index in enumerate(order):
            handle = self._worker(index)
            if handle is None:
                continue
            try:
                return await getattr(handle, method.__name__).remote(*args)
            except (RayActorError, ActorUnavailableError):
                self._handles.pop(index, None)  # look it up again next time
                if attempt == 0:
                    self._record(retries=1)
            except RayTaskError as exc:
                error = worker_exception(exc)
                break
        else:
            raise WorkersUnavailableError(f"no QuantWorker answered {method.__name__} (tried workers {sorted(set(order))})")
        # Raised outside the handler (inside, the worker's error and Ray's wrapper, its cause,
        # would refer to each other) and not kept here (the traceback holds this frame): a
        # cycle would keep the request's body until a GC.
        try:
            raise error
        finally:
            del error

    async def _map(self, method: Callable, items: list, *extra) -> list:
        """Spread ``items`` over the workers in contiguous groups; results in order."""
        groups = split(items, self.num_workers)
        results = await asyncio.gather(*(self._call(method, group, *extra) for group in groups))
        return [r for group in results for r in group]

    # Raw bodies, one block each, that arrive together go to the workers together: a
    # QuantWorker call costs the replica and the worker about a millisecond of CPU each
    # (BENCHMARKS.md, "Serve at the HTTP limit"), its codec work for 64 KiB 0.1 ms.
    # No wait for company: a batch is what is queued when the last one has left.
    @serve.batch(max_batch_size=BATCH_BLOCKS, batch_wait_timeout_s=0.0, max_concurrent_batches=2)
    async def _encode_one(self, requests: list[tuple[Block, object]]) -> list:
        """Each ``(block, options)``'s ``(frame, meta)``, or the exception it raised."""
        by_options: dict = {}
        for index, (block, options) in enumerate(requests):
            by_options.setdefault(options, []).append((index, block))
        answers: list = [None] * len(requests)
        groups = list(by_options.items())
        results = await asyncio.gather(
            *(self._batch(QuantWorker.encode_batch, [b for _, b in group], options) for options, group in groups)
        )
        for (_, group), answered in zip(groups, results):
            for (index, _), answer in zip(group, answered):
                answers[index] = answer
        return answers

    @serve.batch(max_batch_size=BATCH_BLOCKS, batch_wait_timeout_s=0.0, max_concurrent_batches=2)
    async def _decode_one(self, frames: list[tuple[str, np.ndarray]]) -> list:
        """Each ``(key, frame)``'s ``(raw, meta)``, or the exception it raised."""
        return await self._batch(QuantWorker.decode_batch, frames)

    async def _batch(self, method: Callable, items: list, *extra) -> list:
        """``method`` over ``items`` of several requests (spread over the workers); where a
        call fails on its data, its items once more one by one, so that each request gets
        its own answer or its own error, never another request's."""
        try:
            return await self._map(method, items, *extra)
        except WorkersUnavailableError:
            raise
        except Exception as exc:
            if len(items) == 1:  # its request's own error: raised, it would fail the whole serve batch
                return [exc]
        answers = await asyncio.gather(*(self._call(method, [item], *extra) for item in items), return_exceptions=True)
        return [a if isinstance(a, BaseException) else a[0] for a in answers]

    def _record(self, **deltas: int) -> None:
        """Count in this replica; :meth:`_report_loop` reports the totals now and then."""
        self._counts.add(**deltas)
        self._start_reporting()

    def _start_reporting(self) -> None:
        if self._reporter is None:
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            try:
                await self._report()
                # Told of a stop here, by the replica that the stopping command called.
                if await self._stats_actor().poll.remote(self._replica_id(), self._in_flight):
                    self._draining = True  # a stop is never taken back
            except (ValueError, RayActorError, ActorUnavailableError):  # being recreated: asked again next time
                self._stats = None
            except Exception:  # a bug: say so, and keep counting
                logger.exception("reporting the replica's counts failed")

    @staticmethod
    def _replica_id() -> str:
        return serve.get_replica_context().replica_id.unique_id

    def _stats_actor(self):
        """The stats actor's handle; ``ValueError`` while the controller recreates it."""
        if self._stats is None:
            self._stats = serve.get_deployment_actor(STATS_ACTOR)
        return self._stats

    async def _report(self) -> bool:
        """Report this replica's totals to the stats actor if they changed; whether it has them."""
        totals = self._counts.unreported()
        if totals is None:
            return True
        try:
            await self._stats_actor().report.remote(self._replica_id(), totals)
        except (ValueError, RayActorError, ActorUnavailableError):  # being recreated: the next report carries them
            self._stats = None
            return False
        self._counts.reported(totals)
        return True

    # --- HTTP --------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to be over the limit, and
        with 408 once no byte of it has come for ``body_timeout_s``."""
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise RequestError(f"Content-Length {declared!r} is not a number", 400, "Content-Length")
            if int(declared) > self.max_body_bytes:
                raise RequestError(f"body of {declared} bytes exceeds the limit of {self.max_body_bytes}", 413, "body")
        chunks, total = [], 0
        stream = request.stream()
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), self.body_timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise RequestError(
                    f"no byte of the body came for {self.body_timeout_s:g} s (after {total} bytes); send it again", 408, "body"
                ) from None
            total += len(chunk)
            if total > self.max_body_bytes:
                raise RequestError(f"body exceeds the limit of {self.max_body_bytes} bytes", 413, "body")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _answer(self, route: str, request: Request, handler) -> Response:
        """``handler``'s response, or the JSON refusal of what it raised; either within the
        bound its request gives (``response_limit``), with what the handler carries beyond
        it (``request.state.carried_bytes``)."""
        start = time.perf_counter()
        if self._draining:  # not started: its client can send it again, to another service
            response = _refusal_response(503, "the service is stopping", None)
            self._count(route, response.status_code, 0, len(response.body), start)
            return response
        with self._answering():
            return await self._answer_now(route, request, handler, start)

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        """Count a request or handle call in flight while it is answered: a stop drains them."""
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    def _check_not_stopping(self) -> None:
        """A handle call once the service is stopping: refused as an HTTP request is (503)."""
        if self._draining:
            raise RequestError("the service is stopping: call again once it runs (another service)", 503)

    async def _answer_now(self, route: str, request: Request, handler, start: float) -> Response:
        bytes_in = 0
        try:
            query = request.query_params
            single_params({name: len(query.getlist(name)) for name in query})
            body = await self._read_body(request) if request.method == "POST" else b""
            bytes_in = len(body)
            response = await handler(request, body)
        except (ClientDisconnect, TaskCancelledError):  # the client hung up mid-body: not a failure of the service
            # (Serve's proxy may cancel the body's read instead: a TaskCancelledError out of request.stream())
            response = Response(status_code=CLIENT_CLOSED)
        except asyncio.CancelledError:  # the proxy dropped the request (its client hung up): count it, then end
            self._count(route, CLIENT_CLOSED, bytes_in, 0, start)
            raise
        except Exception as exc:
            answer = refusal(exc)
            if answer is None:  # a bug: log it, and answer without its details
                logger.exception("%s %s failed", request.method, route)
                answer = (500, f"internal error ({type(exc).__name__}); the service log has the details", None)
            response = _refusal_response(*answer)
        # What the handler carries that the request does not give: encode's frames, a block read.
        limit = response_limit(bytes_in + len(request.url.query), getattr(request.state, "carried_bytes", 0))
        if len(response.body) > limit:  # cannot happen by the derivation: never send it anyway
            logger.error(
                "%s %s: a %d-byte response to a %d-byte request exceeds its bound",
                request.method,
                route,
                len(response.body),
                bytes_in,
            )
            response = _refusal_response(500, f"internal error: the response would exceed its bound of {limit} bytes", None)
        self._count(route, response.status_code, bytes_in, len(response.body), start)
        return response

    def _count(self, route: str, status: int, bytes_in: int, bytes_out: int, start: float) -> None:
        """One request answered (or dropped) on ``route``: the Prometheus metrics and the
        replica's totals (``/v1/stats``)."""
        self._requests.inc(tags={"route": route, "status": str(status)})
        error = status >= 400 and status != CLIENT_CLOSED  # a client that hung up is no failure of the service
        if error:
            self._errors.inc(tags={"route": route, "status": str(status)})
        for direction, count in (("in", bytes_in), ("out", bytes_out)):
            if count:  # a Counter takes only positive increments
                self._bytes.inc(count, tags={"route": route, "direction": direction})
        self._latency.observe(time.perf_counter() - start, tags={"route": route})
        self._record(
            requests=1, bytes_in=bytes_in, bytes_out=bytes_out, errors=int(error), client_closed=int(status == CLIENT_CLOSED)
        )

    @api.post("/v1/encode")
    async def http_encode(self, request: Request) -> Response:
        return await self._answer("/v1/encode", request, self._encode_body)

    @api.post("/v1/decode")
    async def http_decode(self, request: Request) -> Response:
        return await self._answer("/v1/decode", request, self._decode_body)

    @api.get("/v1/archive/block")
    async def http_archive_block(self, request: Request) -> Response:
        return await self._answer("/v1/archive/block", request, self._block_body)

    @api.get("/healthz")
    async def http_healthz(self, request: Request) -> Response:
        return await self._answer("/healthz", request, self._health)

    @api.get("/v1/stats")
    async def http_stats(self, request: Request) -> Response:
        return await self._answer("/v1/stats", request, self._stats_body)

    async def _encode_body(self, request: Request, body: bytes) -> Response:
        params = dict(request.query_params)
        if is_safetensors(request.headers.get("content-type")):
            for name in ("dtype", "shape"):
                if name in params:
                    raise RequestError(f"{name} comes from the safetensors header, not the query", 400, name)
            options = codec_options(params)
            entries, metadata = parse_body(body, tuple(SOURCE_DTYPES))
            if FRAMES_MARK in metadata:  # it would be overwritten by the mark: refuse, not lose it
                raise RequestError(
                    f"__metadata__ key {FRAMES_MARK!r} is fp8ray's own (it marks a body of frames)", 400, "__metadata__"
                )
            blocks = [Block(e.key, e.fp8ray_dtype, e.shape, data) for e, data in entries]
            self._check_frame_bytes(request, blocks, body, options)
            results = await self._map(QuantWorker.encode_batch, blocks, options)
            frames = [(meta.key, "uint8", (len(f),), f) for f, meta in results]
            # The body's own __metadata__ travels with its frames, and comes back on decode.
            return Response(build_body(frames, {**metadata, FRAMES_MARK: FRAMES_BODY}), media_type=SAFETENSORS)
        options = codec_options(params, ignore=("dtype", "shape"))
        dtype, shape = raw_layout(params.get("dtype"), params.get("shape"), len(body))
        block = Block("body", dtype, shape, np.frombuffer(body, dtype=np.uint8))
        self._check_frame_bytes(request, [block], body, options)
        if len(body) > BATCH_BODY_BYTES:
            [(f, meta)] = await self._call(QuantWorker.encode_batch, [block], options)
        else:
            f, meta = _answer_of(await self._encode_one((block, options)))
        return Response(f.tobytes(), media_type=OCTET_STREAM, headers={"X-Fp8ray-Device": meta.device})

    def _check_frame_bytes(self, request: Request, blocks: list[Block], body: bytes, options) -> None:
        """Refuse with 413, before any work, blocks whose frames would be more than the
        service answers: ``max_body_bytes``, or the bound of the request alone where that
        is more. An empty tensor's frame still holds a scale per channel or row, so a few
        bytes of query can ask for gigabytes. Records their size for the response's
        bound (:func:`response_limit`)."""
        total = sum(frame_sizes(Fp8Codec(options=options), blocks))  # a shape no frame holds: refused naming its block
        allowed = max(self.max_body_bytes, response_limit(len(body) + len(request.url.query)))
        if total > allowed:
            raise RequestError(
                f"the frames would be {total} bytes, over the service's limit of {allowed} (--max-body-mb)", 413, "shape"
            )
        request.state.carried_bytes = total

    async def _decode_body(self, request: Request, body: bytes) -> Response:
        if request.query_params:
            name = next(iter(request.query_params))
            raise unknown_name("option", name, ": a frame describes itself")
        if is_safetensors(request.headers.get("content-type")):
            entries, metadata = parse_body(body, (FRAME_DTYPE,))
            results = await self._map(QuantWorker.decode_batch, [(e.key, data) for e, data in entries])
            tensors = [(meta.key, meta.dtype, meta.shape, raw) for raw, meta in results]
            kept = {k: v for k, v in metadata.items() if k != FRAMES_MARK}
            return Response(build_body(tensors, kept or None), media_type=SAFETENSORS)
        frame = ("body", np.frombuffer(body, dtype=np.uint8))
        if len(body) > BATCH_BODY_BYTES:
            [(raw, meta)] = await self._call(QuantWorker.decode_batch, [frame])
        else:
            raw, meta = _answer_of(await self._decode_one(frame))
        headers = {"X-Fp8ray-Dtype": meta.dtype, "X-Fp8ray-Shape": ",".join(map(str, meta.shape)), "X-Fp8ray-Device": meta.device}
        return Response(raw.tobytes(), media_type=OCTET_STREAM, headers=headers)

    async def _block_body(self, request: Request, body: bytes) -> Response:
        """One block of an archive under the root, as a safetensors body holding it under
        its key with its source file's ``__metadata__`` (a GET has no body whose type to
        follow, as /v1/decode follows its request's). Read and decoded here, in a thread,
        not on a QuantWorker: one block is one frame, and the replica keeps the archive's
        reader (its manifest and part indexes) for the next read. A block whose tensor is
        more than ``max_body_bytes`` is refused with 413 before its frame is read."""
        if self._archives is None:
            raise RequestError("this service was started without --archives: it reads no archives", 404, None)
        params = request.query_params
        for name in params:
            if name not in BLOCK_PARAMS:
                raise unknown_name("parameter", name, f"; expected {list(BLOCK_PARAMS)}")
        if not params.get("key"):
            raise RequestError("key is required: the block's key", 400, "key")
        # A refusal quotes the archive (its path, a key's files): bounded as a block is.
        request.state.carried_bytes = self.max_body_bytes
        response, request.state.carried_bytes = await asyncio.to_thread(
            self._read_block, params.get("archive"), params["key"], params.get("file")
        )
        return response

    def _read_block(self, archive: str | None, key: str, file: str | None) -> tuple[Response, int]:
        """The block's answer, and the bytes of it its request does not give: the block
        and its file's ``__metadata__`` (the key is the request's; a block and metadata at
        the limit answered 500 when only the block was counted)."""
        named = file is not None
        try:
            reader = self._archives.reader(archive)
            if not named:
                file = reader.file_of(key)
            size = reader.nbytes(key, file)
            if size > self.max_body_bytes:
                raise RequestError(
                    f"block {key!r} is {size} bytes, over the service's limit of {self.max_body_bytes} "
                    "(--max-body-mb); read it with fp8ray get",
                    413,
                    "key",
                )
            block = reader.block(key, file)
            if block.nbytes > self.max_body_bytes:  # the recorded size, checked by what the frame held
                raise RequestError(f"block {key!r} is {block.nbytes} bytes, over the service's limit", 413, "key")
        except BadInputError as exc:
            # No such key or file: 404. A key in several files, none named: 400, naming them.
            raise RequestError(str(exc), 400 if not named and exc.field == "file" else 404, exc.field) from None
        except CorruptDataError as exc:  # a damaged manifest, part or frame, named in one line
            raise RequestError(str(exc), 422, "archive") from None
        metadata = reader.metadata(file) or None
        data = build_body([(key, block.dtype, block.shape, block.data)], metadata)
        return Response(data, media_type=SAFETENSORS), block.nbytes + len(header_prefix([], metadata))

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
            raise RequestError(f"none of the {self.num_workers} QuantWorkers answers", 503)
        return JSONResponse({"status": "ok", "workers_alive": alive, "workers": self.num_workers, **self._archives_state()})

    def _archives_state(self) -> dict:
        """The archives root the block route reads (None: off), and whether it is there:
        a root removed since the start makes every block read a 404, the service otherwise well."""
        if not self._archives_root:
            return {"archives": None}
        return {"archives": self._archives_root, "archives_present": os.path.isdir(self._archives_root)}

    async def _stats_body(self, request: Request, body: bytes) -> Response:
        """The totals of every replica: this one's as of now, the others' as of their last
        report (at most ``REPORT_INTERVAL_S`` old)."""
        if not await self._report():
            raise RequestError("the stats actor is restarting", 503)
        try:
            counts = await self._stats_actor().snapshot.remote()
        except (ValueError, RayActorError, ActorUnavailableError):  # being recreated
            self._stats = None
            raise RequestError("the stats actor is restarting", 503) from None
        alive = await self._alive_workers()
        return JSONResponse({**counts, "workers": self.num_workers, "workers_alive": alive, **self._archives_state()})

    # --- Stopping ------------------------------------------------------------------------

    async def drain(self) -> int:
        """Called once by the command stopping the service: every replica answers new HTTP
        requests 503 (each hears of it within ``REPORT_INTERVAL_S``), and this call returns
        once none has a request in flight, or after ``DRAIN_S``; returns how many are
        still in flight, counting a replica not yet told as one (-1: the stats actor never
        answered)."""
        self._draining = True
        deadline = time.monotonic() + DRAIN_S
        busy = -1
        while time.monotonic() < deadline:
            try:
                busy = await self._stats_actor().drain.remote()
            except (ValueError, RayActorError, ActorUnavailableError):
                self._stats = None
            if busy == 0:
                break
            await asyncio.sleep(REPORT_INTERVAL_S / 4)
        return busy

    # --- Python handle API -------------------------------------------------------------

    async def encode(self, tensor, **codec_options_kw) -> bytes:
        """Encode a tensor (or a float16/float32 ndarray); returns the frame's bytes. What
        ``Fp8Codec.encode`` refuses is refused here, by the same message."""
        self._check_not_stopping()
        tensor = source_tensor(tensor)  # loads torch: the HTTP routes take bytes, this API tensors
        # As the query gives them; None is the default, as Fp8Codec takes it (not "None").
        options = codec_options({k: str(v) for k, v in codec_options_kw.items() if v is not None})
        with self._answering():
            [(f, _)] = await self._call(QuantWorker.encode_batch, [Block.of("tensor", tensor.detach())], options)
        return f.tobytes()

    async def decode(self, frame):
        """Decode a frame (bytes, memoryview or uint8 array); returns the tensor."""
        self._check_not_stopping()
        with self._answering():
            [(raw, meta)] = await self._call(QuantWorker.decode_batch, [("frame", np.frombuffer(frame, dtype=np.uint8))])
        return bytes_to_tensor(raw, meta.dtype, meta.shape).clone()  # owns its memory


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
    return deployment.bind(options.workers, options.max_body_bytes, options.archives, options.body_timeout_s)
