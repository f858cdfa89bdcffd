"""The process toolkit's small parts: ports chosen away from the kernel's ephemeral range, secrets kept out of
messages, run tokens that are never read as flags."""

from __future__ import annotations

import argparse
import socket

from miles_core.workers.process import PORT_FLOOR, ephemeral_port_range, free_ports, redacted
from miles_core.workers.rpc.wire import new_run_token


def test_free_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    """Outgoing connections take their local ports from the ephemeral range, so a port chosen there may be taken
    before a slow worker binds it; below it, only another listener can take it."""
    low, high = ephemeral_port_range()
    assert PORT_FLOOR < low <= high
    ports = free_ports(8, "127.0.0.1")
    assert len(set(ports)) == 8
    assert all(PORT_FLOOR <= port < low for port in ports), (ports, low)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_held_by_a_listener_is_never_chosen() -> None:
    listeners = []
    try:
        for port in free_ports(50, "127.0.0.1"):
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            sock.listen()
            listeners.append(sock)
        held = {sock.getsockname()[1] for sock in listeners}
        for _ in range(20):
            assert not held & set(free_ports(50, "127.0.0.1"))
    finally:
        for sock in listeners:
            sock.close()


def test_secret_flags_are_redacted_in_both_forms_and_nothing_else_is() -> None:
    argv = [
        "serve", "--admin-api-key", "s1", "--api-key=s2", "--control-plane-api-keys", "miles:run:admin:s3",
        "--max-total-tokens", "4096", "--skip-tokenizer-init", "--device", "cpu", "--auth_token", "s4",
    ]  # fmt: skip
    assert redacted(argv) == [
        "serve", "--admin-api-key", "***", "--api-key=***", "--control-plane-api-keys", "***",
        "--max-total-tokens", "4096", "--skip-tokenizer-init", "--device", "cpu", "--auth_token", "***",
    ]  # fmt: skip


def test_run_tokens_are_never_read_as_flags() -> None:
    """A token that begins with ``-`` after ``--admin-api-key`` is an argparse error ("expected one argument"): it
    ended a CI run's SGLang engine at its start. 2000 tokens: a URL-safe base64 token begins with ``-`` one time in 64,
    so the old tokens fail this with probability 1 - (63/64)^2000 (above 1 - 1e-13)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--admin-api-key")
    tokens = [new_run_token() for _ in range(2000)]
    assert len(set(tokens)) == 2000 and all(len(token) == 48 for token in tokens)
    for token in tokens:
        assert parser.parse_args(["--admin-api-key", token]).admin_api_key == token
