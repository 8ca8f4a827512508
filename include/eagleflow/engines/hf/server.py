"""The ``hf`` capture server: the capture API over a transformers model, stdlib HTTP only.

For CPU machines, tiny models, tests and the demo. One forward at a time (a
lock): the model is the bottleneck, and the HTTP threads only parse JSON and
wait. Hidden states come from ``output_hidden_states=True``: entry i+1 is the
output of layer i (0-based), the last entry the final post-norm states.

Test hooks (simulate a slow or hung model for the watchdog's tests):
``EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S`` sleeps that long inside every forward;
``EAGLEFLOW_HF_SERVER_DELAY_FILE`` names a file read at every forward whose
content (seconds) is the sleep, so a test can slow a server that is running;
``EAGLEFLOW_HF_SERVER_HANG_FILE`` names a file: while it exists, /generate
requests hang (outside the model lock) while /health_generate still answers,
as SGLang's hung generation path does (sglang issue 4191).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


from eagleflow.phases import EXTRACT, GENERATE, KINDS
from eagleflow.serving.aux_layers import resolve_aux_layers
from eagleflow.serving.launch import dump_dir, write_info_file
from eagleflow.serving.dump_protocol import MAX_BODY_BYTES  # noqa: F401  (the one cap of every server of ours, named here too)
from eagleflow.serving.dump_protocol import (PROTOCOL_VERSION, BodyTooLarge, check_body_size, check_rid, load_dump_key, loopback_host,
                       private_dump_dir, write_dump)

DELAY_ENV = "EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S"
DELAY_FILE_ENV = "EAGLEFLOW_HF_SERVER_DELAY_FILE"
HANG_FILE_ENV = "EAGLEFLOW_HF_SERVER_HANG_FILE"
HEALTH_INPUT = [1, 2, 3, 4]
# the server's modes, as each phase's descriptor names its server's: one prefill + dump (capture), serving
CAPTURE_MODE, SERVING_MODE = KINDS[EXTRACT].server_mode, KINDS[GENERATE].server_mode


class CaptureModel:
    """A causal LM and the capture of its EAGLE-3 hidden states."""

    def __init__(self, model_path: str, dtype: str = "auto", aux_layers: list[int] | None = None,
                 model_name: str | None = None, threads: int | None = None, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        torch_dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16,
                       "float32": torch.float32}[dtype]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("server.device is 'cuda' but torch sees no CUDA GPU here; set server.device: cpu "
                               "(or auto) or install a CUDA build of torch")
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers mis-annotates .to()
        cfg = self.model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.aux_layers = resolve_aux_layers(aux_layers, self.num_layers)
        self.dtype = str(next(self.model.parameters()).dtype).replace("torch.", "")
        self.model_name = model_name or model_path
        self.lock = threading.Lock()

    def forward(self, input_ids: list[int]):
        """(input_ids [L], aux [L, k*H], last [L, H], next token id) for one prefill."""
        import torch

        bad = [t for t in input_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if not input_ids or bad:
            raise ValueError(f"input_ids must be a non-empty list of ints in 0..{self.vocab_size - 1}"
                             + (f"; bad values: {bad[:5]}" if bad else ""))
        ids = torch.tensor([input_ids], dtype=torch.int64, device=self.device)
        with self.lock, torch.inference_mode():
            delay = _forward_delay()
            if delay:
                time.sleep(delay)
            out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
            hs = out.hidden_states
            # the output of layer j is hidden_states[j + 1] (entry 0 is the embedding): the same layers
            # sglang captures as the input of layer j + 1 (eagleflow.serving.aux_layers)
            aux = torch.cat([hs[i + 1][0] for i in self.aux_layers], dim=-1)
            last = hs[-1][0]
            next_id = int(out.logits[0, -1].argmax())
        return ids[0], aux, last, next_id


    def generate_ids(self, input_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0, stop_token_ids: list[int] | None = None) -> tuple[list[int], str]:
        """Serving mode: (new token ids, "stop" | "length"). Sampling draws from a generator seeded per request,
        so one (prompt, seed) gives the same ids every time; temperature 0 is greedy."""
        import torch

        bad = [t for t in input_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if not input_ids or bad:
            raise ValueError(f"input_ids must be a non-empty list of ints in 0..{self.vocab_size - 1}"
                             + (f"; bad values: {bad[:5]}" if bad else ""))
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"sampling_params.max_new_tokens = {max_new_tokens!r}: must be an int >= 1")
        stop = set(stop_token_ids or [])
        out_ids: list[int] = []
        with self.lock, torch.inference_mode():
            delay = _forward_delay()
            if delay:
                time.sleep(delay)
            g = torch.Generator(device="cpu").manual_seed(int(seed) % (1 << 63))
            ids = torch.tensor([input_ids], dtype=torch.int64, device=self.device)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            for _ in range(max_new_tokens):
                logits = out.logits[0, -1].float().cpu()
                tok = _sample(logits, temperature, top_p, g)
                out_ids.append(tok)
                if tok in stop:
                    return out_ids, "stop"
                if len(out_ids) == max_new_tokens:
                    break
                out = self.model(input_ids=torch.tensor([[tok]], device=self.device),
                                 past_key_values=out.past_key_values, use_cache=True)
        return out_ids, "length"


def _sample(logits, temperature: float, top_p: float, g) -> int:
    import torch
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p   # the smallest set reaching top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=g)])
    return int(torch.multinomial(probs, 1, generator=g))


def _forward_delay() -> float:
    delay = float(os.environ.get(DELAY_ENV) or 0)
    path = os.environ.get(DELAY_FILE_ENV)
    if path:
        try:
            delay += float(Path(path).read_text().strip() or 0)
        except (OSError, ValueError):
            pass
    return delay


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("eagleflow")
    except Exception:
        return "unknown"


class CaptureServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, model: CaptureModel, dump_dir: str | None, dump_key: bytes | None = None,
                 mode: str = CAPTURE_MODE):
        if mode == CAPTURE_MODE and dump_dir is None:   # before the port is bound
            raise ValueError("a capture server needs its dump folder: set server.dump_dir")
        super().__init__(addr, CaptureHandler)
        self.capture = model
        self.mode = mode                                  # CAPTURE_MODE (prefill + dump) | SERVING_MODE
        # serving mode writes no dumps: no dump folder is made
        self.dump_dir = str(private_dump_dir(dump_dir)) if dump_dir is not None and mode == CAPTURE_MODE else ""
        self.dump_key = dump_key                          # the node user's dump key: each dump's MAC (protocol.write_dump)
        self.started_at = time.time()

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]   # what server_address holds, as str (AF_INET)
        return f"http://{host}:{port}"

    def server_info(self) -> dict:
        import transformers
        m = self.capture
        return {"backend": "hf", "model": m.model_name, "num_layers": m.num_layers, "aux_layers": m.aux_layers,
                "hidden_size": m.hidden_size, "dtype": m.dtype, "device": str(m.device), "dump_dir": self.dump_dir,
                "version": _package_version(), "transformers_version": transformers.__version__,
                "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "started_at": self.started_at, "mode": self.mode}


class CaptureHandler(BaseHTTPRequestHandler):
    server: CaptureServer
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes; with Nagle on, the body waits for the client's
    # delayed ACK of the headers, which cost ~13 ms a request (0.83 of a bare loop's speed).
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):  # one line per request, to the server log
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {self.address_string()} {fmt % args}\n")

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(200, {"status": "ok"})
        elif path == "/health_generate":
            try:
                _, _, _, tok = self.server.capture.forward(HEALTH_INPUT)
            except Exception as e:  # a broken model answers 503, like sglang
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"{type(e).__name__}: {e}"})
                return
            self._send(200, {"status": "ok", "output_ids": [tok]})
        elif path in ("/get_server_info", "/get_model_info"):
            self._send(200, self.server.server_info())
        else:
            self._send(404, {"error": f"no such endpoint {path}"})

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        if path != "/generate":
            self._send(404, {"error": f"no such endpoint {path}"})
            return
        try:
            try:
                n = check_body_size(int(self.headers.get("Content-Length") or 0))
            except BodyTooLarge as e:
                self.close_connection = True   # the body is left unread
                self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": str(e)})
                return
            req = json.loads(self.rfile.read(n) or b"{}")
            rid = check_rid(req.get("rid"))
            input_ids = req.get("input_ids")
            if not isinstance(input_ids, list):
                raise ValueError("input_ids must be a list of token ids (this server does not tokenise text)")
        except (ValueError, json.JSONDecodeError) as e:
            self._send(400, {"error": str(e)})
            return
        hang = os.environ.get(HANG_FILE_ENV)
        while hang and os.path.exists(hang):  # test hook: a hung /generate beside a live /health_generate
            time.sleep(0.2)
        if self.server.mode == SERVING_MODE:
            self._generate(req, rid, input_ids)
            return
        try:
            ids, aux, last, tok = self.server.capture.forward(input_ids)
        except ValueError as e:
            self._send(400, {"error": str(e)})
            return
        except Exception as e:
            self._send(500, {"error": f"{type(e).__name__}: {e}"})
            return
        m = self.server.capture
        path_ = write_dump(self.server.dump_dir, rid, input_ids=ids, aux_hidden_states=aux, hidden_states=last,
                           aux_layers=m.aux_layers, model=m.model_name, key=self.server.dump_key)
        self._send(200, {"text": "", "output_ids": [tok],
                         "meta_info": {"id": rid, "prompt_tokens": len(input_ids), "completion_tokens": 1,
                                       "dump": str(path_)}})


    def _generate(self, req: dict, rid: str, input_ids: list) -> None:
        """Serving mode, SGLang's /generate shape: output_ids and meta_info.finish_reason.type."""
        sp = req.get("sampling_params") or {}
        t0 = time.monotonic()
        try:
            ids, finish = self.server.capture.generate_ids(
                input_ids, max_new_tokens=sp.get("max_new_tokens", 128), temperature=float(sp.get("temperature", 0.0)),
                top_p=float(sp.get("top_p", 1.0)), seed=int(sp.get("sampling_seed", sp.get("seed", 0)) or 0),
                stop_token_ids=list(sp.get("stop_token_ids") or []))
        except (ValueError, TypeError) as e:
            self._send(400, {"error": str(e)})
            return
        except Exception as e:
            self._send(500, {"error": f"{type(e).__name__}: {e}"})
            return
        self._send(200, {"text": "", "output_ids": ids,
                         "meta_info": {"id": rid, "prompt_tokens": len(input_ids), "completion_tokens": len(ids),
                                       "finish_reason": {"type": finish}, "e2e_latency": time.monotonic() - t0}})


def serve(model_path: str, *, host: str, port: int, dump_dir: str, info_file: str | None,
          aux_layers: list[int] | None = None, dtype: str = "auto", model_name: str | None = None,
          threads: int | None = None, device: str = "cpu", key_file: str | None = None,
          mode: str = CAPTURE_MODE) -> None:
    loopback_host(host)   # before the model loads: no credential is asked, so never on a network address
    model = CaptureModel(model_path, dtype=dtype, aux_layers=aux_layers, model_name=model_name, threads=threads,
                         device=device)
    capture = mode == CAPTURE_MODE
    dump_key = load_dump_key(key_file, create=True) if key_file and capture else None   # dumps' MACs
    server = CaptureServer((host, port), model, dump_dir if capture else None, dump_key, mode=mode)
    dump_dir = server.dump_dir
    info = server.server_info()
    info["url"] = server.url
    if info_file:
        write_info_file(info_file, info)
    print(f"hf {mode} server for {model.model_name} listening on {server.url} "
          f"(layers {model.num_layers}, aux {model.aux_layers}, {model.device}, dumps in {dump_dir})", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


def serve_capture(cfg, layout) -> int:
    """The hf engine's capture server for a run (eagleflow.engines; `eagleflow capture serve`), foreground."""
    model = str(cfg.resolve(cfg.target_model))
    serve(model, host=cfg.server.host, port=cfg.server.port, dump_dir=dump_dir(cfg),
          info_file=str(layout.server_info_file), aux_layers=cfg.capture.aux_layers, dtype=cfg.server.dtype,
          model_name=model, device=cfg.server.device, key_file=str(layout.dump_key_file))
    return 0


def serve_generation(cfg, layout) -> int:
    """The hf engine's generation server (serving mode, no dumps) for a run (`eagleflow generate serve`)."""
    model = str(cfg.resolve(cfg.target_model))
    serve(model, host=cfg.server.host, port=cfg.generate.port, dump_dir="",
          info_file=str(layout.generate_server_info_file), dtype=cfg.server.dtype, model_name=model,
          device=cfg.server.device, mode=SERVING_MODE)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleflow.engines.hf.server", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--dump-dir", help="where dumps go (capture mode; required there)")
    ap.add_argument("--mode", default=CAPTURE_MODE, choices=[CAPTURE_MODE, SERVING_MODE],
                    help=f"{CAPTURE_MODE}: one prefill + hidden-state dump per request; {SERVING_MODE}: serving "
                         "(sampling)")
    ap.add_argument("--info-file")
    ap.add_argument("--key-file", help="the dump key file (created if absent): each dump carries its MAC")
    ap.add_argument("--aux-layers", type=int, nargs="*")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--model-name")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    a = ap.parse_args(argv)
    if a.mode == CAPTURE_MODE and not a.dump_dir:
        ap.error("--dump-dir is required in capture mode")
    try:
        loopback_host(a.host, "--host")
    except ValueError as e:   # ConfigError
        ap.error(str(e))
    serve(a.model, mode=a.mode, host=a.host, port=a.port, dump_dir=a.dump_dir, info_file=a.info_file, key_file=a.key_file,
          aux_layers=a.aux_layers or None, dtype=a.dtype, model_name=a.model_name, threads=a.threads,
          device=a.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
