"""SGLangHttpClient's transport errors: every failure of one call is one SGLangError line."""

from __future__ import annotations

import socket
import threading

import pytest

from gspo_megatron.engines.sglang_client import SGLangError, SGLangHttpClient


def _one_shot_server(answer: bytes) -> tuple[str, threading.Thread]:
    """A socket that answers one request with ``answer`` and closes (a server dying mid-answer)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def serve():
        conn, _ = sock.accept()
        conn.recv(65536)
        conn.sendall(answer)
        conn.close()
        sock.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", t


@pytest.mark.parametrize(
    "answer, expect",
    [
        (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 46\r\n\r\n", "HTTP 500: "),
        (b'HTTP/1.1 500 Internal Server Error\r\nContent-Length: 46\r\n\r\n{"err', "HTTP 500: "),
        (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\nnope!", "HTTP 400: nope!"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 46\r\n\r\n{}", "unreachable"),
    ],
)
def test_a_server_that_closes_mid_answer_gives_one_sglang_error(answer, expect):
    """sglang's scheduler dying on a failed update closes the HTTP server right after its 500;
    the body can be cut short. The call still raises SGLangError with the status, never
    http.client.IncompleteRead."""
    url, t = _one_shot_server(answer)
    with pytest.raises(SGLangError, match=r"^POST http") as err:
        SGLangHttpClient(url, timeout_s=10).post("update_weights_from_tensor", {"x": 1})
    t.join(5)
    assert expect in str(err.value)
