"""Fake llama.cpp binaries for the benchmark's tests: small stdlib scripts that take the
real ones' arguments. The fake llama-server answers /health, streams a token per SSE
chunk (text and chat completions, with usage) and answers /completion (the greedy
check's) with token ids 0..n_predict-1 (without them: ``completion_token_ids`` false); one
made with ``die_after`` = N dies (exit 3, "fake crash" in its log) on its N-th request
of any of these. The fake RPC server accepts connections and closes them. The fake
llama-bench is ``bench``: by default it prints nothing and exits 0; BENCH_* are others."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

SERVER = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if "--version" in sys.argv:
    print("version: 1 (fake)")
    sys.exit(0)
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
die_after = DIE_AFTER
completion_token_ids = COMPLETION_TOKEN_IDS
served = [0]
print("load_tensors: offloaded 0/31 layers to GPU", flush=True)

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        served[0] += 1
        if die_after and served[0] >= die_after:
            print("fake crash", flush=True)
            os._exit(3)
        if self.path == "/completion":
            n = int(request.get("n_predict", 4))
            answer = {"content": "a" * n}
            if completion_token_ids:
                answer["tokens"] = list(range(n))
            body = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        n = int(request.get("max_tokens", 4))
        prompt = request.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 20
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = self.path.endswith("chat/completions")
        for _ in range(n):
            choice = {"delta": {"content": "a"}} if chat else {"text": "a"}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
        usage = {"completion_tokens": n, "prompt_tokens": prompt_tokens}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

ThreadingHTTPServer((host, port), Handler).serve_forever()
'''

RPC = r'''
import socket, sys
args = sys.argv[1:]
host, port = args[args.index("-H") + 1], int(args[args.index("-p") + 1])
server = socket.create_server((host, port))
print(f"Starting RPC server on {host}:{port}", flush=True)
while True:
    conn, _ = server.accept()
    conn.close()
'''

TRIVIAL = "import sys\nsys.exit(0)\n"
# llama-bench: one that prints an empty JSON list; one that hangs after its first line.
BENCH_EMPTY_JSON = 'import sys\nprint("[]")\nprint("llama-bench: no runs", file=sys.stderr)\n'
BENCH_HANGS = ('import sys, time\nprint("llama-bench: loading the model", file=sys.stderr, '
               'flush=True)\ntime.sleep(600)\n')


def write_script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_llama_cpp(directory: Path, die_after: int = 0, completion_token_ids: bool = True,
                   bench: str = TRIVIAL) -> Path:
    """A directory of fake llama.cpp binaries (``die_after``, ``completion_token_ids``,
    ``bench``: see above; ``die_after`` 0: never)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_script(directory / "llama-server", f"DIE_AFTER = {die_after}\n"
                 f"COMPLETION_TOKEN_IDS = {completion_token_ids}\n{SERVER}")
    write_script(directory / "ggml-rpc-server", RPC)
    write_script(directory / "llama-bench", bench)
    write_script(directory / "llama-quantize", TRIVIAL)
    return directory
