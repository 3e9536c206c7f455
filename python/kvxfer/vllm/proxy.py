"""A prefill/decode proxy for two vLLM OpenAI servers, as vLLM's disaggregation examples run.

For each completion request: send it to the prefill server with max_tokens=1, stream off and
kv_transfer_params {"do_remote_decode": true}; take the kv_transfer_params of its answer (the
producer connector's request_finished() result) and send the original request, with those
params, to the decode server; relay the decode answer (streamed or not) to the client. Both
legs carry the same X-Request-Id, so the two servers' request ids share a base.

A client that goes away cancels the handler (handler_cancellation): the open upstream request
is closed, which vLLM treats as a client abort of that request on that server. The one gap is
a client gone after the prefill answered and before the decode request is sent: the producer
then holds the request's blocks until its connector gives them back (KvxferConnector: when
the room's ``bootstrap_timeout_ms`` passes). Each such cancellation is logged with the leg that
was open (``request <id>: client went away during the prefill|decode leg``).

It serves KvxferConnector and vLLM's NixlConnector alike (both answer the prefill leg with
``do_remote_prefill`` params for the decode). Listens on loopback unless told otherwise;
aiohttp comes with vLLM.

    python -m kvxfer.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid

import aiohttp
from aiohttp import web

log = logging.getLogger("kvxfer.vllm.proxy")

# Fields a prefill leg must not carry: it produces exactly one token, unstreamed.
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: dict) -> dict:
    p = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return p


async def _relay_error(resp: aiohttp.ClientResponse, leg: str) -> web.Response:
    text = await resp.text()
    log.warning("%s answered %d: %s", leg, resp.status, text[:500])
    return web.Response(status=resp.status, text=text, content_type="application/json")


async def handle(request: web.Request) -> web.StreamResponse:
    app = request.app
    session: aiohttp.ClientSession = app["session"]
    path = request.path
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        return web.json_response({"error": f"bad JSON: {e}"}, status=400)
    if not isinstance(body, dict):
        return web.json_response({"error": "body must be a JSON object"}, status=400)
    req_id = request.headers.get("X-Request-Id") or str(uuid.uuid4())
    headers = {"X-Request-Id": req_id}

    leg = "prefill"
    try:
        async with session.post(
            app["prefill"] + path, json=prefill_body(body), headers=headers
        ) as resp:
            if resp.status != 200:
                return await _relay_error(resp, "prefill")
            answer = await resp.json()
        params = answer.get("kv_transfer_params")
        app["stats"]["prefilled"] += 1

        leg = "decode"
        decode = dict(body)
        if params:
            decode["kv_transfer_params"] = params
        async with session.post(app["decode"] + path, json=decode, headers=headers) as resp:
            if resp.status != 200:
                return await _relay_error(resp, "decode")
            out = web.StreamResponse(
                status=200, headers={"Content-Type": resp.headers.get("Content-Type", "")}
            )
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            leg = "done"
            await out.write_eof()
    except asyncio.CancelledError:
        if leg != "done":  # a client closing after the last byte cancelled nothing
            app["stats"]["cancelled_" + leg] += 1
            log.info("request %s: client went away during the %s leg", req_id, leg)
        raise
    app["stats"]["decoded"] += 1
    return out


async def health(request: web.Request) -> web.Response:
    session: aiohttp.ClientSession = request.app["session"]
    for leg in ("prefill", "decode"):
        try:
            async with session.get(request.app[leg] + "/health") as r:
                if r.status != 200:
                    return web.Response(status=503, text=f"{leg} {r.status}")
        except aiohttp.ClientError as e:
            return web.Response(status=503, text=f"{leg}: {e}")
    return web.json_response({"status": "ok", **request.app["stats"]})


async def _session(app: web.Application):
    app["session"] = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None),
        connector=aiohttp.TCPConnector(limit=0),
    )
    yield
    await app["session"].close()


def make_app(prefill: str, decode: str) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app["prefill"] = prefill.rstrip("/")
    app["decode"] = decode.rstrip("/")
    app["stats"] = {"prefilled": 0, "decoded": 0, "cancelled_prefill": 0, "cancelled_decode": 0}
    app.cleanup_ctx.append(_session)
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="base URL of the prefill vLLM")
    ap.add_argument("--decode", required=True, help="base URL of the decode vLLM")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    web.run_app(
        make_app(args.prefill, args.decode),
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        print=None,
    )


if __name__ == "__main__":
    main()
