#!/usr/bin/env python
"""A minimal disaggregation proxy for two `vllm serve` instances that use the KVDConnector.

Each POST to /v1/completions goes first to the prefill instance with max_tokens=1 and
kv_transfer_params={"do_remote_decode": true, "kvd_dest": <decode daemon>}, then to the decode
instance with the kv_transfer_params the prefill response returned. Standard library only.

    python examples/vllm_proxy.py --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 \\
        --decode-kvd tcp://10.0.0.2:7470 --port 8000

Without --decode-kvd the decode daemon pulls from the prefill daemon instead (kvd_source), or, when
the daemons share a cluster registry (`kvd serve --registry ...`), from whichever node the registry
says holds each shard: the proxy then needs no kvd address at all (and --decode-kvd, to push, may be
the decode node's id).
Streaming responses are not proxied (the decode request is sent with stream=false).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def disaggregated(body: dict, prefill: str, decode: str, decode_kvd: str | None, timeout: float,
                  path: str = "/v1/completions") -> dict:
    """Prefill (one token, KV handed to kvd), then decode with the returned kv_transfer_params."""
    first = dict(body, max_tokens=1, stream=False,
                 kv_transfer_params={"do_remote_decode": True, **({"kvd_dest": decode_kvd} if decode_kvd else {})})
    first.pop("max_completion_tokens", None)
    prefilled = post(prefill + path, first, timeout)
    params = prefilled.get("kv_transfer_params")
    if not params:
        raise RuntimeError("the prefill instance returned no kv_transfer_params: is it started with the "
                           "KVDConnector (--kv-transfer-config)?")
    return post(decode + path, dict(body, stream=False, kv_transfer_params=params), timeout)


def make_handler(args: argparse.Namespace):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                return self._reply(404, {"error": f"no route {self.path}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                result = disaggregated(body, args.prefill, args.decode, args.decode_kvd, args.timeout, self.path)
            except urllib.error.HTTPError as exc:
                return self._reply(exc.code, {"error": exc.read().decode(errors="replace")})
            except Exception as exc:
                return self._reply(502, {"error": str(exc)})
            self._reply(200, result)

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="prefill instance base URL, e.g. http://10.0.0.1:8100")
    parser.add_argument("--decode", required=True, help="decode instance base URL")
    parser.add_argument("--decode-kvd",
                        help="the decode node's kvd peer endpoint (or node id, on a registry): prefill pushes there")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args))
    print(f"proxy on http://{args.host}:{args.port} -> prefill {args.prefill}, decode {args.decode}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
