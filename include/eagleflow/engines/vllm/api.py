"""The project's capture API (``protocol``'s docstring) on vLLM's own server, as an ASGI middleware of ours.

The extraction worker, the readiness check and the watchdog speak one API to every capture server:
``POST /generate`` {"input_ids", "rid", "sampling_params"}, ``GET /health_generate`` (a real one-token
generation), ``GET /get_server_info``. ``vllm serve`` speaks OpenAI's; ``--middleware
eagleflow.engines.vllm.api.CaptureApi`` (vLLM's own option: ``add_middleware`` of an import path) answers
these three paths by calling vLLM's own ``/v1/completions`` in-process, and passes everything else through:

- ``/generate``: a completion of the token ids (``max_new_tokens`` tokens, greedy unless told otherwise),
  the rid in its ``kv_transfer_params`` so our connector (``connector.py``) writes that request's dump
  before vLLM answers; the answer is ``{"output_ids", "meta_info": {"id", "finish_reason"}}`` as sglang's;
- ``/health_generate``: a one-token completion without a rid (no dump), 200 when it ran;
- ``/get_server_info``: what the launcher handed the connector (model, aux layers), backend vllm.

``GenerateApi`` is the same API for the generation server (``engines/vllm/generate_server.py``: ``vllm serve`` in
serving mode, no connector): no rid goes to a connector, and ``/get_server_info`` says mode generate. Both
answer exactly the token ids vLLM sampled (``return_token_ids``; no detokenise/retokenise) and vLLM's finish
reason, and both set every sampling knob the worker does not choose to its neutral value, so the model's
``generation_config.json`` (which ``vllm serve`` applies as its defaults) never changes what was asked.

Every request body through it is capped at ``serving.dump_protocol.MAX_BODY_BYTES``, the hf server's cap: one
announced larger (Content-Length) is answered 413 unread, and one that streams past the cap stops being read
there (413 on our paths; on vLLM's own, its handler fails reading the body and a 413 answers when it had not
answered yet).

Import-light (json, os, the capture protocol): vLLM imports it in its API process; nothing here needs vLLM.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Awaitable, Callable

from eagleflow.serving.dump_protocol import MAX_BODY_BYTES, PROTOCOL_VERSION, BodyTooLarge, check_body_size
from eagleflow.serving.capture_hook import ENV_AUX_LAYERS, ENV_MODEL
from eagleflow.engines.vllm.connector import KV_PARAM_RID
from eagleflow.phases import GENERATE, KINDS

MIDDLEWARE = f"{__name__}.CaptureApi"     # what the launcher passes to vLLM's --middleware
COMPLETIONS = "/v1/completions"
HEALTH_PROMPT = [0]                        # any id is inside any vocabulary; no rid: no dump

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


# vLLM's server defaults come from the model's generation_config.json (top_k, min_p, repetition_penalty...):
# set explicitly, they cannot change the sampling the config asked for (temperature, top_p, seed)
NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}


def completion_body(req: dict[str, Any], model: str | None, *, capture: bool = True) -> dict[str, Any]:
    """``POST /generate``'s body as a vLLM completion request (token ids in, token ids out). ``capture``: the
    rid goes to our connector in ``kv_transfer_params``; a generation server (no connector) sends none."""
    ids, rid = req.get("input_ids"), req.get("rid")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ValueError("input_ids must be a non-empty list of token ids")
    sp = req.get("sampling_params") or {}
    body: dict[str, Any] = {"prompt": ids, "max_tokens": int(sp.get("max_new_tokens", 1)),
                            "temperature": float(sp.get("temperature", 0.0)), "return_token_ids": True,
                            **NEUTRAL_SAMPLING}
    if model:
        body["model"] = model
    for ours, theirs in (("top_p", "top_p"), ("sampling_seed", "seed"), ("stop_token_ids", "stop_token_ids"),
                         ("skip_special_tokens", "skip_special_tokens")):
        if ours in sp:
            body[theirs] = sp[ours]
    if rid is not None and capture:
        body["kv_transfer_params"] = {KV_PARAM_RID: rid}
    return body


def generate_answer(completion: dict[str, Any], rid: str | None) -> dict[str, Any]:
    """vLLM's completion answer in sglang's ``/generate`` shape (what ``client.generate_tokens`` reads): the
    token ids vLLM sampled, as it sampled them. An answer without them is refused (ValueError), never read as
    an empty generation."""
    choice = (completion.get("choices") or [{}])[0]
    finish = choice.get("finish_reason")
    ids = choice.get("token_ids")
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ValueError(f"vLLM's {COMPLETIONS} answer has no token_ids list (got {str(ids)[:80]}): it was asked "
                         "with return_token_ids; is this vLLM the version requirements-node-vllm.txt pins?")
    return {"text": choice.get("text", ""), "output_ids": list(ids),
            "meta_info": {"id": rid, "finish_reason": {"type": finish} if finish else None,
                          "kv_transfer_params": choice.get("kv_transfer_params")
                          or completion.get("kv_transfer_params")}}


def server_info(env: Mapping[str, str] | None = None, mode: str = "capture") -> dict[str, Any]:
    src = os.environ if env is None else env
    try:
        aux = json.loads(src.get(ENV_AUX_LAYERS, "null"))
    except ValueError:
        aux = None
    return {"backend": "vllm", "mode": mode, "model": src.get(ENV_MODEL, ""), "aux_layers": aux,
            "protocol": PROTOCOL_VERSION, "pid": os.getpid()}


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length header, when it has one that is a number."""
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BoundedReceive:
    """An ASGI ``receive`` that counts the request body's bytes and raises BodyTooLarge once they pass
    ``limit``: nothing past the cap is handed on, whoever reads the body (our paths or vLLM's)."""

    def __init__(self, receive: Receive, limit: int = MAX_BODY_BYTES):
        self.receive, self.limit, self.size = receive, limit, 0

    async def __call__(self) -> Message:
        msg = await self.receive()
        if msg["type"] == "http.request":
            self.size += len(msg.get("body", b""))
            check_body_size(self.size, self.limit, so_far=True)
        return msg


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole request body, at most ``limit`` bytes (BodyTooLarge beyond: the rest is never read)."""
    bounded = receive if isinstance(receive, BoundedReceive) else BoundedReceive(receive, limit)
    chunks, more = [], True
    while more:
        msg = await bounded()
        if msg["type"] == "http.disconnect":
            break
        chunks.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    return b"".join(chunks)


async def _json(send: Send, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class CaptureApi:
    """ASGI middleware: the three capture paths answered through vLLM's ``/v1/completions``, the rest untouched."""
    capture = True     # each /generate's rid goes to our connector (the capture server)

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app
        self.model = os.environ.get(ENV_MODEL) or None   # vLLM's served name: the model path the launcher gave

    async def _complete(self, scope: Scope, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        data = json.dumps(body).encode()
        inner = {**scope, "method": "POST", "path": COMPLETIONS, "raw_path": COMPLETIONS.encode(), "query_string": b"",
                 "headers": [(k, v) for k, v in scope.get("headers", [])
                             if k.lower() not in (b"content-length", b"content-type")]
                 + [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        status, chunks = 500, []

        async def send(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            elif msg["type"] == "http.response.body":
                chunks.append(msg.get("body", b""))
        await self.app(inner, receive, send)
        raw = b"".join(chunks)
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"error": raw[:500].decode(errors="replace")}
        return status, payload if isinstance(payload, dict) else {"value": payload}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            check_body_size(declared_length(scope) or 0)
        except BodyTooLarge as e:   # announced over the cap: answered before a byte of it is read
            return await _json(send, e.status, {"error": f"{scope.get('method')} {scope.get('path')}: {e}"})
        receive = BoundedReceive(receive)
        route = (scope.get("method"), scope.get("path"))
        if route == ("POST", "/generate"):
            try:
                req = json.loads(await read_body(receive) or b"{}")
                body = completion_body(req, self.model, capture=self.capture)
            except BodyTooLarge as e:
                return await _json(send, e.status, {"error": f"POST /generate: {e}"})
            except (ValueError, TypeError, AttributeError) as e:
                return await _json(send, 400, {"error": f"POST /generate: {e}"})
            status, out = await self._complete(scope, body)
            if status != 200:
                return await _json(send, status, {"error": out.get("error") or out.get("message") or out})
            try:
                answer = generate_answer(out, req.get("rid"))
            except ValueError as e:
                return await _json(send, 502, {"error": f"POST /generate: {e}"})
            return await _json(send, 200, answer)
        if route == ("GET", "/health_generate"):
            status, out = await self._complete(scope, {"prompt": HEALTH_PROMPT, "max_tokens": 1, "temperature": 0.0,
                                                       **({"model": self.model} if self.model else {})})
            return await _json(send, status, {} if status == 200 else {"error": out})
        if route == ("GET", "/get_server_info"):
            return await _json(send, 200, server_info(mode="capture" if self.capture else KINDS[GENERATE].server_mode))
        await self._pass_on(scope, receive, send)

    async def _pass_on(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's own paths, their bodies capped too: a body that streams past the cap fails its reader; 413 when
        nothing was answered yet."""
        started = False

        async def tracked(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)
        try:
            await self.app(scope, receive, tracked)
        except BodyTooLarge as e:
            if started:
                raise
            await _json(send, e.status, {"error": f"{scope.get('method')} {scope.get('path')}: {e}"})


class GenerateApi(CaptureApi):
    """The same API on the generation server (``vllm serve`` in serving mode, no connector loaded): the
    worker's ``/generate`` (``client.generate_tokens``) sampled by vLLM, no rid handed to a connector."""
    capture = False


GENERATE_MIDDLEWARE = f"{__name__}.GenerateApi"   # what the generation launcher passes to --middleware
