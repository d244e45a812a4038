"""A reward server with injected faults, for the remote-reward tests: the reference server's handler
(gspo_megatron/rewards/reference_server.py), failing chosen requests the way a broken server does."""

import socket
import threading
import time

import pytest

from gspo_megatron.rewards.reference_server import RewardHandler, make_server


class Faults:
    """Per request number (1-based, in arrival order): 'hang', 'error' (HTTP 500), 'drop' (close the
    connection without an answer, as a server dying mid-request does), or nothing (answer)."""

    def __init__(self, plan=None):
        self.plan, self.count, self.lock = dict(plan or {}), 0, threading.Lock()
        self.release = threading.Event()  # set at teardown: hanging handlers return
        self.open, self.max_open = 0, 0


def faulty_handler(faults: Faults):
    class Handler(RewardHandler):
        done = False  # this request no longer counts as open

        def _close_request(self):
            with faults.lock:
                if not self.done:
                    self.done = True
                    faults.open -= 1

        def _send(self, code, payload):
            # the request stops counting as open before its answer leaves: once the client has the
            # answer it may send the next request while this thread is still on its way out
            self._close_request()
            super()._send(code, payload)

        def do_POST(self):
            with faults.lock:
                faults.count += 1
                kind = faults.plan.get(faults.count)
                faults.open += 1
                faults.max_open = max(faults.max_open, faults.open)
                self.done = False
            try:
                if kind == "hang":
                    faults.release.wait(600)
                    return
                if kind == "error":
                    self.read_batch()
                    self._send(500, {"error": "injected"})
                    return
                if kind == "drop":
                    self.read_batch()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                time.sleep(0.05)  # let requests overlap, so the in-flight bound is exercised
                super().do_POST()
            finally:
                self._close_request()

    return Handler


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(spec, group=False, plan=None):
        faults = Faults(plan)
        server = make_server(spec, group=group, handler=faulty_handler(faults))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started.append((server, thread, faults))
        return f"http://127.0.0.1:{server.server_address[1]}/score", faults

    yield start
    for server, thread, faults in started:
        faults.release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
