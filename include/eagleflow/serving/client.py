"""A minimal client for our target servers' API, whatever their engine and role (stdlib http.client: no extra
dependency on the node).

Every call has a timeout; a server that accepts the connection and never
answers raises ``ServerTimeout`` after it, never hangs.
"""
from __future__ import annotations

import http.client
import json
import socket
from urllib.parse import urlsplit


class ServerError(RuntimeError):
    """A target server (capture, generation or evaluation; any engine) could not be reached or answered with an
    error.

    ``http_status``: the server's answer when it was not 200; ``cause``: the connection error when it
    could not be reached (ConnectionRefusedError: nothing listens), so a caller can tell them apart.
    """

    def __init__(self, message: str, *, http_status: int | None = None, cause: BaseException | None = None):
        super().__init__(message)
        self.http_status, self.cause = http_status, cause


class ServerTimeout(ServerError):
    pass


# The names these had while only the capture server used them: phases/extract/worker.py and the tests still catch them.
CaptureServerError = ServerError
CaptureTimeout = ServerTimeout


def request_json(url: str, method: str, path: str, body: dict | None, timeout_s: float) -> dict:
    """One JSON request to a target server of ours (any engine, any role) and its JSON answer; ServerError
    (ServerTimeout) naming the server and why when it cannot be had."""
    u = urlsplit(url)
    if not u.hostname:
        raise ServerError(f"the server URL {url!r} names no host; expected http://<host>:<port> (the "
                                 "server's info file gives it)")
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout_s)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.connect()
        # A long sample's token ids (> 2 kB) go out after the headers in a second write:
        # without NODELAY, Nagle holds them until the server's delayed ACK.
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except (socket.timeout, TimeoutError):
        raise ServerTimeout(f"{method} {url}{path} got no answer within {timeout_s:.1f} s") from None
    except (ConnectionError, OSError, http.client.HTTPException) as e:
        raise ServerError(f"{method} {url}{path} failed: {type(e).__name__}: {e}", cause=e) from None
    finally:
        conn.close()
    try:
        payload = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        payload = {"raw": raw[:500].decode(errors="replace")}
    if resp.status != 200:
        raise ServerError(f"{method} {url}{path} answered HTTP {resp.status}: "
                                 f"{payload.get('error') or payload}", http_status=resp.status)
    return payload if isinstance(payload, dict) else {"value": payload}


def generate(url: str, input_ids: list[int], rid: str, timeout_s: float) -> dict:
    """One prefill with capture; a one-token generation (the dump is the point, not the text)."""
    return request_json(url, "POST", "/generate",
                    {"input_ids": input_ids, "rid": rid,
                     "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}, timeout_s)


def health_generate(url: str, timeout_s: float) -> dict:
    return request_json(url, "GET", "/health_generate", None, timeout_s)


def server_info(url: str, timeout_s: float = 10.0) -> dict:
    return request_json(url, "GET", "/get_server_info", None, timeout_s)


def generate_tokens(url: str, input_ids: list[int], rid: str, *, max_new_tokens: int, temperature: float,
                    top_p: float, seed: int, stop_token_ids: list[int], timeout_s: float) -> tuple[list[int], str]:
    """Serving mode (hf generate mode or sglang): (output ids, finish "stop" | "length"), deterministic per seed."""
    out = request_json(url, "POST", "/generate",
                   {"input_ids": input_ids, "rid": rid,
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                        "top_p": top_p, "sampling_seed": seed, "stop_token_ids": stop_token_ids,
                                        "skip_special_tokens": False, "no_stop_trim": True}}, timeout_s)
    ids = out.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ServerError(f"POST {url}/generate answered without output_ids (a list of token ids): "
                                 f"{str(out)[:200]}; is this a generation server?")
    finish = (out.get("meta_info") or {}).get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length"):
        # an abort (sglang: out of memory, a cancelled or invalid request) is no turn the target finished
        msg = finish.get("message") if isinstance(finish, dict) else None
        raise ServerError(f"POST {url}/generate: request {rid} ended with finish_reason {finish!r}"
                                 f"{f' ({msg})' if msg else ''}, not stop or length: the generation was "
                                 "aborted; read the server's log")
    return ids, kind
