"""A generation the server aborted is an error naming the request, not a turn that stopped."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagleflow.serving.client import CaptureServerError, generate_tokens


def _serve(finish):
    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"output_ids": [5, 6], "meta_info": {"finish_reason": finish}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _gen(srv):
    return generate_tokens(f"http://127.0.0.1:{srv.server_address[1]}", [1, 2], "rid-7", max_new_tokens=4,
                           temperature=0.0, top_p=1.0, seed=1, stop_token_ids=[6], timeout_s=10)


@pytest.mark.parametrize("finish,want", [({"type": "stop", "matched": 6}, "stop"), ({"type": "length"}, "length")])
def test_stop_and_length_are_the_targets_own_finishes(finish, want):
    srv = _serve(finish)
    try:
        assert _gen(srv) == ([5, 6], want)
    finally:
        srv.shutdown()


@pytest.mark.parametrize("finish,match", [
    ({"type": "abort", "message": "out of memory"}, r"rid-7 ended with finish_reason .*'abort'.*\(out of memory\)"),
    ({"type": "weird"}, r"rid-7 ended with finish_reason .*'weird'"),
    (None, r"rid-7 ended with finish_reason None")])
def test_an_abort_or_unknown_finish_is_an_error_naming_the_request(finish, match):
    srv = _serve(finish)
    try:
        with pytest.raises(CaptureServerError, match=match):
            _gen(srv)
    finally:
        srv.shutdown()
