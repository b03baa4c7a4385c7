"""A client gone without a FIN or RST, as when its host or network vanishes: every packet from
its socket to the server dropped (needs root and iptables; tests skip without)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from .raw_http import RawClient


@contextmanager
def silenced(client: RawClient, server_port: int) -> Iterator[None]:
    """Every packet from the client's socket to the server is dropped while inside."""
    client_port = client.writer.get_extra_info("sockname")[1]
    rule = [
        "INPUT",
        "-p",
        "tcp",
        "-s",
        "127.0.0.1",
        "--sport",
        str(client_port),
        "--dport",
        str(server_port),
        "-j",
        "DROP",
    ]
    subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-D", *rule], check=True, capture_output=True)


def can_drop_packets() -> bool:
    """Whether `silenced` works here (root, and an iptables that answers)."""
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        return False
    probe = subprocess.run(["iptables", "-L", "INPUT", "-n"], capture_output=True)
    return probe.returncode == 0
