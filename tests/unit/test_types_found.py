"""What mypy found when it first ran over the package (tests/unit/test_types.py): a None that reached an
attribute access or a call, now refused with a message that names the thing."""
from __future__ import annotations

import http.server
import threading

import pytest

from eagleflow.serving.client import CaptureServerError, server_info
from eagleflow.engines.hf.server import CaptureServer


@pytest.fixture
def listener():
    """An HTTP server on a free loopback port that records every request it gets."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            seen.append(self.path)
            body = b'{"model": "someone else"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv.server_address[1], seen
    srv.shutdown()
    srv.server_close()
    t.join()


def test_a_server_url_without_a_host_is_a_capture_server_error(listener):
    # urlsplit("http://:PORT").hostname is None: http.client raised a TypeError, which no caller of the client
    # (they catch CaptureServerError: readiness polls, health checks, the workers) expects
    port, seen = listener
    with pytest.raises(CaptureServerError, match=rf"the server URL 'http://:{port}' names no host"):
        server_info(f"http://:{port}", timeout_s=5.0)
    assert seen == []
    assert server_info(f"http://127.0.0.1:{port}", timeout_s=5.0) == {"model": "someone else"}   # the listener works
    assert seen == ["/get_server_info"]


def test_a_capture_server_without_a_dump_folder_is_refused_before_binding():
    with pytest.raises(ValueError, match="a capture server needs its dump folder: set server.dump_dir"):
        CaptureServer(("127.0.0.1", 0), None, None)   # the model is not looked at before the check
