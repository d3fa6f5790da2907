"""`dflash regenerate --server URL` where nothing listens: one attempt and one line, not minutes of retries.
Timeouts keep their retries, and so does a refused connection once the server has answered (a restart)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.regenerate.server import OpenAIServerBackend, ServerError

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml"


@pytest.fixture
def closed_port():
    """A port bound by this test but not listening: a connection to it is refused, and no one else takes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def silent_port():
    """A port that accepts connections (the kernel's backlog) and never answers: every request times out."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def attempts(monkeypatch):
    """The HTTP requests the backend makes, by URL (each try of `call` is one)."""
    made: list[str] = []
    real = OpenAIServerBackend._request

    def counted(self, method, url, body=None, timeout=None):
        made.append(url)
        return real(self, method, url, body, timeout)

    monkeypatch.setattr(OpenAIServerBackend, "_request", counted)
    return made


def test_a_refused_connection_at_start_up_fails_at_once_with_one_line(closed_port, attempts):
    url = f"http://127.0.0.1:{closed_port}/v1"
    with pytest.raises(ServerError) as err:
        OpenAIServerBackend(url, None, None, retries=6, backoff_s=0.01)
    assert attempts == [f"{url}/models"]  # one try: no retry
    message = str(err.value)
    assert "\n" not in message
    assert f"connection refused: nothing listens on 127.0.0.1:{closed_port}" in message and "--server" in message


def test_without_the_start_up_check_the_first_request_fails_at_once_too(closed_port, attempts):
    from dflash.regenerate.core import SamplingParams

    backend = OpenAIServerBackend(f"http://127.0.0.1:{closed_port}/v1", "m", None, retries=6, backoff_s=0.01,
                                  check=False)
    with pytest.raises(ServerError, match="connection refused"):
        backend.generate([[{"role": "user", "content": "hi"}]], SamplingParams(max_new_tokens=4))
    assert len(attempts) == 1


def test_a_refused_connection_after_the_server_answered_is_retried(closed_port, attempts):
    backend = OpenAIServerBackend(f"http://127.0.0.1:{closed_port}/v1", "m", None, retries=2, backoff_s=0.01,
                                  check=False)
    backend.answered = True  # it answered before: now it is restarting
    with pytest.raises(ServerError, match="failed 3 times, last: ConnectionRefusedError"):
        backend.call("GET", f"{backend.base_url}/models")
    assert len(attempts) == 3


def test_a_timeout_at_start_up_keeps_its_retries(silent_port, attempts):
    url = f"http://127.0.0.1:{silent_port}/v1"
    backend = OpenAIServerBackend(url, None, None, retries=1, backoff_s=0.01, timeout_s=0.3, check=False)
    with pytest.raises(ServerError, match="failed 2 times"):
        backend.call("GET", f"{url}/models", timeout=0.3)
    assert len(attempts) == 2


def test_the_cli_reports_one_line(closed_port, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": [{"role": "user", "content": "count by 1 from w1"}]}) + "\n")
    code = main(["regenerate", str(inp), str(tmp_path / "out.jsonl"), "--target-config", str(TINY),
                 "--server", f"http://127.0.0.1:{closed_port}/v1"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.count("\n") == 0 and err.startswith("dflash: error: GET ") and "connection refused" in err
