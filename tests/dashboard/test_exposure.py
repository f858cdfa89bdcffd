"""The dashboard answers this machine's browser only, and stays up for it under hostile clients:

* DNS rebinding: a request whose ``Host`` is not a name the dashboard serves (``evil.example``, a look-alike, the
  right name with the wrong port, none at all) is refused with a 421 that carries nothing of the run;
* slow clients (slowloris: connections that never finish their request, or send nothing) cost no thread each,
  keep nobody else waiting, and are disconnected once the request head's deadline passes, as is an idle keep-alive
  connection;
* an empty or blank host (which would bind every interface) is refused by ``miles dashboard --host``, the
  ``dashboard.host`` setting and ``DashboardServer`` alike;
* paths, query parameters and ``--port`` take ASCII digits only (``int("١٢")`` is 12: ``/api/steps/١٢`` must not
  be step 12).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from miles_core.builtin.dashboard.hosts import DashboardHostError, allowed_host_names, host_header_matches
from miles_core.builtin.dashboard.server import KEEP_ALIVE_S, DashboardServer
from miles_core.builtin.dashboard.store import DashboardStore
from miles_core.http import HEAD_TIMEOUT_S
from tests.conftest import run_miles
from tests.dashboard.test_api import sample
from tests.dashboard.test_cli import error_of

SECRET = "/very/private/model/path"


@pytest.fixture
def served(tmp_path: Path, serve) -> tuple[str, int]:
    """A run with a config and steps 0, 1 and 12 recorded, served: ``(base URL, port)``."""
    store = DashboardStore(tmp_path)
    store.run_started(run_dir=str(tmp_path), start_step=0, num_steps=20, config={"model": {"path": SECRET}})
    for step in (0, 1, 12):
        store.add_samples(step=step, samples=[sample(0, "a"), sample(1, "b")])
    store.close()
    url = serve(tmp_path)
    return url, int(url.rstrip("/").rsplit(":", 1)[1])


def raw_get(port: int, head: bytes) -> tuple[int, bytes]:
    """Send ``head`` (a request without its final blank line) as it is, and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(head + b"Connection: close\r\n\r\n")
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


# -- DNS rebinding -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:{port}",
        "127.0.0.1.evil.example:{port}",
        "localhost.evil.example:{port}",
        "localhost:{other}",
        "127.0.0.1:{other}",
        "[::1]:{other}",
        "127.0.0.1",
        "localhost",
        "127.0.0.1:{port}:{port}",
        "127.0.0.1:{port}@evil.example",
        "127.0.0.1 :{port}",
        "127.0.0.1:+{port}",
        "127.0.0.1:\u0661\u0662",
    ],
)
@pytest.mark.parametrize("path", ["/api/run", "/api/steps/0/samples/0/0", "/", "/samples/0", "/static/app.js"])
def test_a_foreign_host_header_is_refused(served, host: str, path: str) -> None:
    url, port = served
    header = host.format(port=port, other=port + 1 if port < 65535 else port - 1)
    response = httpx.get(url.rstrip("/") + path, headers={"Host": header.encode()}, timeout=30)
    assert (response.status_code, response.headers["content-type"]) == (421, "application/json"), response.text
    assert "is not a name this dashboard serves" in response.json()["error"]
    assert SECRET not in response.text


def test_a_request_without_a_host_header_is_refused(served) -> None:
    _, port = served
    status, body = raw_get(port, b"GET /api/run HTTP/1.0\r\n")
    assert status == 421 and SECRET.encode() not in body


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "[::1]:{port}"])
def test_the_names_it_serves_are_answered(served, host: str) -> None:
    url, port = served
    response = httpx.get(url + "api/run", headers={"Host": host.format(port=port)}, timeout=30)
    assert response.status_code == 200 and response.json()["config"]["model"]["path"] == SECRET


def test_host_names_of_a_server_bound_to_every_interface() -> None:
    """Bound to 0.0.0.0, the machine's own names are served too, and still no other name."""
    names = allowed_host_names("0.0.0.0")
    assert {"127.0.0.1", "localhost", "[::1]", socket.gethostname().lower()} <= names
    assert host_header_matches(f"{socket.gethostname()}:8123", names=names, port=8123)
    assert not host_header_matches("evil.example:8123", names=names, port=8123)
    assert allowed_host_names("127.0.0.1") == {"127.0.0.1", "localhost", "[::1]"}
    assert host_header_matches("dash.internal:80", names=allowed_host_names("dash.internal"), port=80)
    assert host_header_matches("dash.internal", names=allowed_host_names("dash.internal"), port=80)


# -- slow clients --------------------------------------------------------------------------------------------


def test_slow_clients_cost_no_thread_and_keep_nobody_waiting(served) -> None:
    """300 connections that never finish a request (half stop inside the headers, half send nothing) leave the
    dashboard answering at once; the old server held a thread for each, forever."""
    url, port = served
    threads_before = threading.active_count()
    slow: list[socket.socket] = []
    try:
        for index in range(300):
            connection = socket.create_connection(("127.0.0.1", port), timeout=30)
            slow.append(connection)
            if index % 2:
                connection.sendall(b"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nX-Slow: 1" % port)
        response = httpx.get(url + "api/steps", timeout=30)
        assert response.status_code == 200 and len(response.json()["steps"]) == 3
        assert threading.active_count() - threads_before < 50, "a thread per slow connection"
    finally:
        for connection in slow:
            connection.close()


def test_an_idle_keep_alive_connection_is_closed_by_the_server(served) -> None:
    _, port = served
    with socket.create_connection(("127.0.0.1", port), timeout=KEEP_ALIVE_S + 30) as connection:
        connection.sendall(b"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += connection.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        while connection.recv(65536):  # the rest of the body, then the server's close (or the socket timeout)
            pass


@pytest.mark.parametrize("sent", [b"", b"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1"], ids=["nothing", "half a head"])
def test_a_client_that_does_not_finish_its_request_head_is_disconnected(served, sent: bytes) -> None:
    _, port = served
    with socket.create_connection(("127.0.0.1", port), timeout=HEAD_TIMEOUT_S + 30) as connection:
        connection.sendall(sent)
        assert connection.recv(65536) == b""  # closed by the server (a socket timeout fails the test instead)


def test_a_client_that_trickles_its_request_head_is_disconnected(served) -> None:
    """One header byte a second keeps no connection open past the head's deadline."""
    _, port = served
    give_up = time.monotonic() + HEAD_TIMEOUT_S + 30
    with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
        connection.sendall(b"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nX-Slow: " % port)
        while time.monotonic() < give_up:
            try:
                connection.sendall(b"x")
                if connection.recv(65536) == b"":
                    return  # closed by the server
            except TimeoutError:
                continue  # nothing to read yet: the next byte
            except (BrokenPipeError, ConnectionResetError):
                return
    pytest.fail(f"a trickling client was still connected {HEAD_TIMEOUT_S + 30} s later")


# -- the bound host ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["", " ", "\t", " 127.0.0.1"])
def test_miles_dashboard_refuses_a_blank_host(tmp_path: Path, host: str) -> None:
    DashboardStore(tmp_path).close()
    message = error_of(str(tmp_path), "--host", host)
    assert message.startswith(
        f"miles: error: --host: the dashboard host must be an address or a name such as "
        f"127.0.0.1, got {host!r} (an empty host would bind every interface"
    )


@pytest.mark.parametrize("host", ["", " "])
def test_the_dashboard_host_setting_refuses_a_blank_host(host: str) -> None:
    result = run_miles("config", "show", "--dashboard-host", host, env={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"dashboard.host = {host!r}" in result.stderr and "would bind every interface" in result.stderr


def test_the_server_refuses_a_blank_host_and_binds_nothing(tmp_path: Path) -> None:
    DashboardStore(tmp_path).close()
    with pytest.raises(DashboardHostError, match="would bind every interface"):
        DashboardServer(tmp_path, host="")


# -- ASCII digits --------------------------------------------------------------------------------------------


# Digits of other scripts, which \\d, str.isdigit and int() all take: Arabic-Indic 12 and 0, fullwidth 12, NKo 12,
# and a superscript two (isdigit, but not int)
ARABIC_12, ARABIC_0, FULLWIDTH_12, NKO_12, SUPERSCRIPT_2 = (
    "\u0661\u0662",
    "\u0660",
    "\uff11\uff12",
    "\u07c1\u07c2",
    "\u00b2",
)


@pytest.mark.parametrize(
    ("path", "status"),
    [
        (f"api/steps/{ARABIC_12}", 400),
        (f"api/steps/{FULLWIDTH_12}", 400),
        (f"api/steps/{NKO_12}", 400),
        (f"api/steps/{SUPERSCRIPT_2}", 400),
        (f"api/steps/{ARABIC_12}/samples", 400),
        (f"api/steps/12/samples/{ARABIC_0}/{ARABIC_0}", 400),
        (f"api/steps/12/samples/0/{ARABIC_0}", 400),
        (f"api/steps/12/samples?offset={ARABIC_0}", 400),
        (f"api/steps/12/samples?limit={ARABIC_12}", 400),
        (f"api/steps/12/samples?limit={SUPERSCRIPT_2}", 400),
        (f"samples/{ARABIC_12}", 404),
        (f"samples/12/{ARABIC_0}/{ARABIC_0}", 404),
        (f"samples/{FULLWIDTH_12}", 404),
    ],
)
def test_non_ascii_digits_are_not_numbers(served, path: str, status: int) -> None:
    url, _ = served
    response = httpx.get(url + path, timeout=30)
    assert (response.status_code, response.headers["content-type"]) == (status, "application/json"), response.text
    assert response.json()["error"]
    assert httpx.get(url + "api/steps/12", timeout=30).status_code == 200  # step 12 itself is recorded


@pytest.mark.parametrize("port", [ARABIC_12, SUPERSCRIPT_2, FULLWIDTH_12, "+80", " 80", "0x50"])
def test_the_port_flag_takes_ascii_digits_only(tmp_path: Path, port: str) -> None:
    assert f"{port!r} is not a port (0..65535; 0 picks a free one)" in error_of(str(tmp_path), "--port", port)
