"""Issue 52 item 4: extra server args cannot undo what our launchers set, and every server of ours caps bodies.

`server.extra_server_args` (capture.extra_server_args before the server section; also generation's) and
`eval.extra_server_args` came after our own flags, so
`--host 0.0.0.0` or another `--middleware` silently undid the loopback-only launch (argparse takes the last
value; vLLM appends middlewares). Now the config refuses, when it is loaded, an extra arg that sets a flag one
of our launchers owns (eagleflow.server_flags.OWNED_FLAGS), however argparse or vLLM's parser would read it:
`--flag=value`, an abbreviation, `_` for `-`, `--flag.key`, `--no-flag`, a short alias, one item with a space.
Each spelling is shown to reach the owned flag in a plain argparse parser (allow_abbrev, as sglang's), so
the refusals are not of flags nobody would read. The vLLM middleware (our ASGI layer on `vllm serve`) refused
no body size: it is served here by a real uvicorn, over real HTTP, in front of a stand-in for vLLM's app.
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import threading
import time

import pytest
import yaml

from eagleflow.engines.sglang import launcher as sglang_launcher
from eagleflow.engines.vllm import launcher as vllm_launcher
from eagleflow.serving.dump_protocol import MAX_BODY_BYTES
from eagleflow.config import ConfigError, SpecConfig, load_config
from eagleflow.engines.sglang import evaluator as sglang_backend
from eagleflow.engines.vllm import evaluator as vllm_backend
from eagleflow.engines.vllm import generate_server as vllm_server
from eagleflow.server_flags import OWNED_FLAGS, owned_flag_of, owned_option_names

pytestmark = pytest.mark.timeout(120)

# (spelling, the flag it sets, whether Python's argparse itself reads it so): each as one list item, or the flag
# then its value as two. The others are vLLM's parser's spellings, or ones no parser reads as the flag but that
# are refused all the same (an item with a space, upper case, an ambiguous prefix).
SPELLINGS = [
    (["--host", "0.0.0.0"], "--host", True),
    (["--host=0.0.0.0"], "--host", True),
    (["--host 0.0.0.0"], "--host", False),
    (["--ho", "0.0.0.0"], "--host", True),              # argparse's abbreviation
    (["--ho=0.0.0.0"], "--host", True),
    (["--HOST", "0.0.0.0"], "--host", False),
    (["--port", "8000"], "--port", True),
    (["--po=8000"], "--port", True),
    (["--middleware", "evil.module.App"], "--middleware", True),
    (["--mid=evil.module.App"], "--middleware", True),
    (["--kv-transfer-config", "{}"], "--kv-transfer-config", True),
    (["--kv_transfer_config={}"], "--kv-transfer-config", False),             # vLLM reads _ as -
    (["--kv-transfer-config.kv_connector", "X"], "--kv-transfer-config", False),   # vLLM's one-key form
    (["--speculative-config", "{}"], "--speculative-config", True),
    (["--speculative-config.method=eagle3"], "--speculative-config", False),
    (["--speculative-draft-model-path", "/other"], "--speculative-draft-model-path", True),
    (["--spec", "x"], "--speculative", False),
    (["--trust-remote-code"], "--trust-remote-code", True),
    (["--trust_remote_code"], "--trust-remote-code", False),
    (["--trust"], "--trust-remote-code", True),
    (["--no-trust-remote-code"], "--trust-remote-code", False),                # vLLM's boolean negation
    (["--enable-prefix-caching"], "--enable-prefix-caching", True),
    (["--disable-radix-cache"], "--disable-radix-cache", True),
    (["-tp", "8"], "--tp-size", True),
    (["-tp=8"], "--tp-size", True),
    (["--tp", "8"], "--tp-size", True),
    (["--tensor-parallel-size=8"], "--tensor-parallel-size", True),
    (["--dtype", "float16"], "--dtype", True),
    (["--config", "flags.yaml"], "--config", True),
    (["--model", "/other"], "--model", True),
    (["--seed=1"], "--seed", True),
    (["--max-logprobs", "50"], "--max-logprobs", True),
]
LEGIT = [["--mem-fraction-static", "0.8"], ["--max-model-len", "512"], ["--gpu-memory-utilization=0.3"],
         ["--enforce-eager"], ["--model-impl", "transformers"], ["--config-format", "hf"], ["--tokenizer-mode", "auto"],
         ["--served-model-name", "t"], ["--cuda-graph-bs", "1", "2"], ["-O3"], []]


def _data(field: str, args: list[str]) -> dict:
    section = field.split(".")[0]
    return {"target_model": "/models/t", section: {"extra_server_args": args}}


# capture.extra_server_args: the old name (before the server section) is still read, and named as written
@pytest.mark.parametrize("field", ["server.extra_server_args", "capture.extra_server_args", "eval.extra_server_args"])
@pytest.mark.parametrize("args,flag", [s[:2] for s in SPELLINGS], ids=[" ".join(s[0]) for s in SPELLINGS])
def test_config_load_refuses_each_spelling_of_an_owned_flag(field, args, flag):
    with pytest.raises(ConfigError) as e:
        load_config(data=_data(field, ["--mem-fraction-static", "0.8", *args]))
    msg = str(e.value)
    assert f"{field} sets {flag}" in msg, msg
    assert f"Remove it from {field}" in msg and "eagleflow.server_flags.OWNED_FLAGS" in msg
    for value in ("0.0.0.0", "evil.module", "flags.yaml", "/other"):   # the flag is named, its value never
        assert value not in msg


def test_the_error_says_what_to_do_and_a_yaml_file_is_refused_the_same(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"target_model": "/models/t",
                                    "capture": {"backend": "hf", "extra_server_args": ["--ho=0.0.0.0"]}}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "capture.extra_server_args sets --host (written '--ho')" in msg
    # the old name the file used is named as written; the field it did not use by its new name
    assert "loopback" in msg and "set server.host" in msg and "0.0.0.0" not in msg


@pytest.mark.parametrize("args", LEGIT, ids=[" ".join(a) or "none" for a in LEGIT])
def test_engine_flags_we_do_not_own_pass(args):
    cfg = load_config(data={"target_model": "/m", "server": {"extra_server_args": args},
                            "eval": {"extra_server_args": args}})
    assert cfg.server.extra_server_args == args == cfg.eval.extra_server_args


def test_an_assignment_is_checked_too():
    cfg = load_config(data={"target_model": "/m"})
    with pytest.raises(ValueError, match="server.extra_server_args sets --middleware"):
        cfg.server.extra_server_args = ["--middleware", "x.Y"]


def _engine_like_parser() -> argparse.ArgumentParser:
    """argparse as sglang uses it (abbreviations allowed), with every owned flag (a family: some of its members)
    beside flags of the engines' own."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for entry in OWNED_FLAGS:
        names = [f"{entry.names[0]}-{m}" for m in ("config", "draft-model-path")] if entry.family else entry.names
        for i, n in enumerate(names):
            shorts = [f"-{s}" for s in entry.short] if i == len(names) - 1 else []
            p.add_argument(f"--{n}", *shorts, dest=n, nargs="?", const="on")
    for theirs in ("--mem-fraction-static", "--max-model-len", "--enforce-eager", "--model-impl",
                   "--served-model-name"):
        p.add_argument(theirs, nargs="?", const="on")
    return p


@pytest.mark.parametrize("args,flag", [s[:2] for s in SPELLINGS if s[2]], ids=[" ".join(s[0]) for s in SPELLINGS
                                                                               if s[2]])
def test_each_refused_spelling_sets_that_flag_in_argparse(args, flag):
    """The refusals are of real spellings: argparse, as the engines use it, reads each as the owned flag (vLLM's
    own spellings, `_`, `.key`, `--no-`, are its parser's: tests/node_vllm runs vLLM)."""
    got = vars(_engine_like_parser().parse_args(args))
    assert got[flag.lstrip("-")] is not None, got


def _cfg(tmp_path):
    return load_config(data={"target_model": "/models/t", "run_root": str(tmp_path),
                             "node": {"has_gpu": True}, "capture": {"backend": "sglang"},
                             "server": {"tp": 2, "dtype": "bfloat16"},
                             "eval": {"extra_server_args": []}})


def _options(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("-") and not a.lstrip("-")[:1].isdigit()]   # -1 is a value


def test_every_flag_a_launcher_sets_is_in_the_one_owned_list(tmp_path):
    """One list, complete: each option every launcher writes (capture, generation, evaluation; sglang and vLLM)
    is one that the config keeps extra server args from setting."""
    cfg = _cfg(tmp_path)
    sc = SpecConfig(steps=3, topk=1, draft_tokens=4)
    commands = {
        "sglang capture": sglang_launcher.build_command(cfg, model_path="/m", host="127.0.0.1", port=1,
                                                        sglang_layer_ids=[1, 2, 3], python="py"),
        "sglang generate": sglang_launcher.build_generate_command(cfg, model_path="/m", host="127.0.0.1", port=1,
                                                                  python="py"),
        "vllm capture": vllm_launcher.build_command(cfg, model_path="/m", host="127.0.0.1", port=1,
                                                    capture_ids=[1, 2, 3, 4], python="py"),
        "vllm generate": vllm_server.build_command(cfg, model_path="/m", host="127.0.0.1", port=1, python="py"),
        "sglang eval, target alone": sglang_backend.build_command(cfg, model_path="/m", host="127.0.0.1", port=1,
                                                                  draft_dir=None, sc=None, python="py"),
        "sglang eval, with the draft": sglang_backend.build_command(cfg, model_path="/m", host="127.0.0.1", port=1,
                                                                    draft_dir="/d", sc=sc, python="py"),
        "vllm eval, target alone": vllm_backend.build_command(cfg, model_path="/m", host="127.0.0.1", port=1,
                                                              draft_dir=None, sc=None, python="py"),
        "vllm eval, with the draft": vllm_backend.build_command(cfg, model_path="/m", host="127.0.0.1", port=1,
                                                                draft_dir="/d", sc=sc, python="py"),
    }
    unowned = {name: [o for o in _options(argv)[1:] if owned_flag_of(o) is None]   # [0]: python's -m
               for name, argv in commands.items()}
    assert unowned == {name: [] for name in commands}, unowned
    # and each is named in the list as written (or a member of a family), not only caught as an abbreviation
    families = tuple(f"--{n}-" for e in OWNED_FLAGS if e.family for n in e.names)
    written = {o.replace("--no-", "--") for argv in commands.values() for o in _options(argv)[1:]}
    assert not {o for o in written if o not in owned_option_names() and not o.startswith(families)}


# ------------------------------------------------------------------------------- the vLLM middleware's cap
class _StandIn:
    """What vLLM's app does with a body on its own paths (here /v1/completions read to the end); records what
    it was handed."""

    def __init__(self):
        self.bytes_seen = 0
        self.completions = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            self.bytes_seen += len(msg.get("body", b""))
            more = msg.get("more_body", False)
        self.completions += scope["path"] == "/v1/completions"
        body = json.dumps({"choices": [{"token_ids": [7], "finish_reason": "length", "text": ""}]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def middleware_server():
    import uvicorn

    from eagleflow.engines.vllm.api import CaptureApi
    inner = _StandIn()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(CaptureApi(inner), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port, inner
    finally:
        server.should_exit = True
        t.join(timeout=10)


def _post(port: int, path: str, *, declared: int | None = None, chunks=(), timeout: float = 60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.putrequest("POST", path)
    c.putheader("Content-Type", "application/json")
    if declared is not None:
        c.putheader("Content-Length", str(declared))
    else:
        c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    try:
        for chunk in chunks:
            c.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if declared is None else chunk)
        if declared is None:
            c.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass   # the server answered and closed before all of it was sent: the answer is still there to read
    r = c.getresponse()
    out = r.status, json.loads(r.read() or b"{}")
    c.close()
    return out


def test_the_vllm_middleware_refuses_a_body_announced_over_the_cap_unread(middleware_server):
    port, inner = middleware_server
    for path in ("/generate", "/v1/completions"):
        status, body = _post(port, path, declared=MAX_BODY_BYTES + 1, chunks=[b'{"input_ids": [1, 2'])
        assert status == 413, body
        assert str(MAX_BODY_BYTES) in body["error"] and "MAX_BODY_BYTES" in body["error"] and path in body["error"]
    assert inner.bytes_seen == 0 and inner.completions == 0
    status, body = _post(port, "/generate", declared=len(b'{"input_ids": [1, 2]}'), chunks=[b'{"input_ids": [1, 2]}'])
    assert status == 200 and body["output_ids"] == [7]   # a body within the cap is served as before


def test_the_vllm_middleware_stops_reading_a_streamed_body_at_the_cap(middleware_server):
    port, inner = middleware_server
    chunk = b" " * (4 << 20)
    n = MAX_BODY_BYTES // len(chunk) + 2      # no Content-Length: chunked, past the cap
    for path in ("/generate", "/v1/completions"):
        status, body = _post(port, path, chunks=[b'{"input_ids": [1]'] + [chunk] * n)
        assert status == 413, body
        assert "at least" in body["error"] and str(MAX_BODY_BYTES) in body["error"] and path in body["error"]
    assert inner.bytes_seen <= MAX_BODY_BYTES + len(chunk) and inner.completions == 0
