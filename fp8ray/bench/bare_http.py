"""The bare HTTP baseline of ``fp8ray bench serve``: a FastAPI app on uvicorn, in a
process of its own, that reads each request's body and answers ``answer`` bytes (the
size of the service's answer) with no codec, no Ray and no checks: what HTTP alone
costs in this environment.

    python -m fp8ray.bench.bare_http PORT
"""

import sys

from fastapi import FastAPI, Request
from fastapi.responses import Response

app = FastAPI()


@app.post("/v1/encode")
async def encode(request: Request) -> Response:
    body = await request.body()
    answer = int(request.query_params.get("answer", len(body)))
    return Response(body[:answer].ljust(answer, b"\0"), media_type="application/octet-stream")


@app.get("/healthz")
async def healthz() -> Response:
    return Response(b"ok")


if __name__ == "__main__":
    import uvicorn

    # Serve's proxy runs uvicorn with the same defaults, its access log off.
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
