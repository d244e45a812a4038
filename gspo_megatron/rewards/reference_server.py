"""A small reference reward server speaking the schema of ``gspo_megatron/rewards/remote.py``: it
scores with any reward spec the trainer accepts (a built-in, a task, ``path/to/file.py:fn``), per
sample or per group. For tests, and as a starting point for a reward-model or judge server.

    python -m gspo_megatron.rewards.reference_server --function last_digit --port 8000 [--group]
    gspo-train ... reward.url=http://127.0.0.1:8000/score

POST (any path) scores a batch; GET /health answers ``{"ok": true}``. An item whose reward raises
gets ``null`` (the trainer counts it as an error), a batch that is not valid JSON of the schema gets
HTTP 400. Requests are served on threads (``ThreadingHTTPServer``).
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from gspo_megatron.rewards.grouping import call_reward


class RewardServer(ThreadingHTTPServer):
    """The HTTP server with what its handlers score with: ``fn`` (the reward spec's function) and
    ``group`` (``fn(prompt, [responses], label)`` per group)."""

    fn: Callable[..., Any]
    group: bool


class RewardHandler(BaseHTTPRequestHandler):
    """Scores ``{"mode", "items"}`` with ``self.server.fn``; answers ``{"rewards": [...]}``."""

    protocol_version = "HTTP/1.1"
    server: RewardServer  # (the one make_server builds)

    def log_message(self, format, *args):  # quiet: one line per request is noise
        pass

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # http.server's naming
        if self.path.rstrip("/") == "/health":
            self._send(200, {"ok": True})
        else:
            self._send(404, {"error": f"no route {self.path}; POST a batch to score it"})

    def read_batch(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length))

    def score_batch(self, batch: dict) -> list:
        """One reward (or, with mode group, one list) per item; None where the function raised."""
        group = batch.get("mode") == "group"
        if group != self.server.group:
            raise ValueError(
                f"this server scores mode {'group' if self.server.group else 'single'}, "
                f"the request asks for {batch.get('mode')!r}"
            )
        out = []
        for item in batch["items"]:
            call = (item["prompt"], item["responses"] if group else item["response"], item.get("label"))
            try:
                out.append(call_reward(self.server.fn, call, group))
            except Exception:  # noqa: BLE001 - the trainer counts a null as an error
                out.append(None)
        return out

    def do_POST(self):
        try:
            batch = self.read_batch()
            rewards = self.score_batch(batch)
        except (ValueError, KeyError, TypeError) as e:
            self._send(400, {"error": f"{type(e).__name__}: {e}"})
            return
        self._send(200, {"rewards": rewards})


def make_server(
    spec: str, host: str = "127.0.0.1", port: int = 0, group: bool = False, handler: type[RewardHandler] = RewardHandler
) -> RewardServer:
    """A server (not yet serving: call ``serve_forever()``) scoring with reward spec ``spec``;
    port 0 picks a free port (``server.server_address[1]``)."""
    from gspo_megatron.rewards.registry import get_reward_fn

    server = RewardServer((host, port), handler)
    server.daemon_threads = True
    server.fn, server.group = get_reward_fn(spec), group
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gspo_megatron.rewards.reference_server",
        description="Reference reward server (gspo_megatron/rewards/remote.py schema).",
    )
    parser.add_argument("--function", default="last_digit", help="reward spec, as reward.function")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 = a free port (printed)")
    parser.add_argument("--group", action="store_true", help="score groups: fn(prompt, responses, label) -> list")
    args = parser.parse_args(argv)
    server = make_server(args.function, args.host, args.port, args.group)
    host, port = server.server_address[:2]
    assert isinstance(host, str)  # an AF_INET server's address (typeshed also allows bytes)
    print(
        f"reward server listening on http://{host}:{port}/score ({args.function}, "
        f"mode {'group' if args.group else 'single'})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
