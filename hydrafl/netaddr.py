"""Where a gRPC address points: for the warnings about clear-text connections off this machine, and for
saying why a coordinator cannot be reached (a name that does not resolve, or nothing listening)."""

from __future__ import annotations

import ipaddress
import socket

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


def unreachable_reason(host_port: str, timeout_s: float = 2.0) -> tuple[str, bool]:
    """Why HOST:PORT cannot be reached, in words, and whether waiting can help: a name that does not resolve
    will not start resolving (a typo), a closed port opens when the coordinator starts."""
    target = host_port.strip()
    if target.startswith(LOCAL_SCHEMES) or any(
        target.startswith(s) for s in ("dns:", "ipv4:", "ipv6:")
    ):
        return f"{target} does not answer", True
    host, port = _host(target), target.rpartition(":")[2]
    if not port.isdigit() or target.count(":") == 0:
        return f"{target!r} is not HOST:PORT", False
    try:
        addresses = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        return f"the host name {host!r} does not resolve ({error.strerror})", False
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.settimeout(timeout_s)
            try:
                probe.connect(address)
            except ConnectionRefusedError:
                return (
                    f"nothing listens on {host}:{port} (connection refused); is `hydrafl server` running there?",
                    True,
                )
            except OSError as error:
                return (
                    f"{host}:{port} cannot be reached ({error.strerror or error}); a firewall or a wrong port?",
                    True,
                )
            return (
                f"{host}:{port} accepts connections but does not answer gRPC (TLS on one side only?)",
                True,
            )
    return f"{host} has no address", False


def _host(target: str) -> str:
    if target.startswith("["):
        return target[1:].partition("]")[0]
    if target.count(":") == 1:
        return target.partition(":")[0]
    return target  # a bare host, or a bare IPv6 address


GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:")
MAX_PORT = 65535


def check_address(flag: str, text: str, *, bare_port: bool = False) -> None:
    """Refuse an address whose port no socket can have, before anything starts: gRPC would otherwise serve a
    port out of range modulo 65536 (--listen 127.0.0.1:70000 listens on 4464). HOST:PORT, [V6]:PORT, a unix:
    or dns:/ipv4:/ipv6: target (left to gRPC), or with `bare_port` a PORT alone. Pure: no name is resolved."""
    from hydrafl.validation import ConfigError

    target = text.strip()
    if target.startswith(LOCAL_SCHEMES + GRPC_SCHEMES):
        return
    host, colon, port = target.rpartition(":")
    if not colon and bare_port:
        host, port = "127.0.0.1", target
    wanted = "HOST:PORT" + (" or PORT" if bare_port else "")
    if not host or not port.isdigit():
        raise ConfigError(
            f"invalid {flag}={text!r}: expected {wanted}, the port a number in 0..{MAX_PORT}"
        )
    if int(port) > MAX_PORT:
        raise ConfigError(
            f"invalid {flag}={text!r}: port {int(port)} is out of range; expected {wanted} with the "
            f"port in 0..{MAX_PORT}"
        )
