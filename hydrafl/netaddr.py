"""Where a gRPC address points, for the warnings about clear-text connections off this machine."""

from __future__ import annotations

import ipaddress

LOCAL_SCHEMES = ("unix:", "unix-abstract:")


def is_loopback(host_port: str) -> bool:
    """Whether HOST:PORT (or [V6]:PORT, a bare host, a dns:/ipv4:/ipv6: or unix: gRPC target) stays on this
    machine: 127.0.0.0/8, ::1, localhost or a unix socket. Any other name counts as remote."""
    target = host_port.strip()
    if target.startswith(LOCAL_SCHEMES):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :].split(",")[0]
            break
    host = _host(target).lower()
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def _host(target: str) -> str:
    if target.startswith("["):
        return target[1:].partition("]")[0]
    if target.count(":") == 1:
        return target.partition(":")[0]
    return target  # a bare host, or a bare IPv6 address
