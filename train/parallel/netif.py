"""The network interface gloo uses between nodes, chosen when the user has not set ``GLOO_SOCKET_IFNAME``.

gloo takes its address from this host's name. Where the name maps to ``127.0.1.1`` (as Debian's
installer writes ``/etc/hosts``) or does not resolve, it listens on loopback, and a rank on another
node fails with ``connectFullMesh failed ... remote=[127.0.1.1]``. longsft uses gloo on CPUs and, on
GPUs too, for its waiting groups. So on a world that spans nodes it picks the interface itself:

1. the interface this node reaches ``MASTER_ADDR`` (the rendezvous host) through, when that is not
   loopback: traffic to the other nodes takes that way already;
2. on the rendezvous host itself (its name maps to loopback here): the interface that holds the
   address this host's name resolves to, else the only up non-loopback IPv4 interface (container
   bridges, ``docker*``, ``virbr*``, ``br-*``, do not count, as in NCCL);
3. several and none of them named: nothing is set, and a warning names them and the variable.

Nothing is chosen when ``MASTER_ADDR`` is ``localhost`` or a loopback address (all the world's
agents are on this host), nor for an IPv6-only rendezvous (set ``GLOO_SOCKET_IFNAME``). NCCL
chooses its own interfaces; set ``NCCL_SOCKET_IFNAME`` on nodes with several networks.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8
_NOT_A_NETWORK = ("docker", "virbr", "br-")  # container and VM bridges on the host


def interfaces() -> dict[str, str]:
    """Up, non-loopback interfaces with an IPv4 address, container bridges left out: ``{name: address}``."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            if name.startswith(_NOT_A_NETWORK):
                continue
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address
                continue
            if flags & _IFF_UP and not flags & _IFF_LOOPBACK:
                out[name] = addr
    return out


def _resolve(host: str, family: int = socket.AF_INET) -> list[str]:
    try:
        return [a[4][0] for a in socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)]
    except (OSError, UnicodeError):  # gaierror, or EAI_SYSTEM as a plain OSError
        return []


def _source_address(addr: str) -> str | None:
    """The local address the kernel sends from to reach ``addr`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))
        except OSError:  # no route
            return None
        return s.getsockname()[0]


def choose(master_addr: str, ifaces: dict[str, str] | None = None) -> tuple[str | None, str]:
    """``(interface, why)`` for gloo on a node of a multi-node world whose rendezvous host is
    ``master_addr``; ``(None, why not)`` when it cannot tell."""
    ifaces = interfaces() if ifaces is None else ifaces
    by_addr = {a: n for n, a in ifaces.items()}
    for target in _resolve(master_addr):
        src = _source_address(target)
        if src in by_addr:
            return by_addr[src], f"the interface that reaches MASTER_ADDR={master_addr} ({target})"
    for addr in _resolve(socket.gethostname()):
        if addr in by_addr:
            return by_addr[addr], f"the interface of this host's name {socket.gethostname()} ({addr})"
    if len(ifaces) == 1:
        name = next(iter(ifaces))
        return name, f"this node's only network interface besides loopback ({ifaces[name]})"
    listed = ", ".join(f"{n} ({a})" for n, a in sorted(ifaces.items())) or "none"
    return None, (f"cannot tell which network interface reaches the other nodes: MASTER_ADDR={master_addr} and this "
                  f"host's name {socket.gethostname()} resolve to loopback or nothing here, and the up interfaces "
                  f"are {listed}. gloo keeps its own choice; if ranks fail with 'connectFullMesh failed', set "
                  "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPUs) to the interface of the network the nodes share")


def setup_gloo_interface(env=os.environ, say=None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` for a multi-node world (torchrun's environment) unless it is set;
    returns the interface chosen, or None when nothing was needed."""
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if env.get("GLOO_SOCKET_IFNAME") or world <= local:
        return None
    master = env.get("MASTER_ADDR", "")
    if not master or master == "localhost" or not _resolve(master) and _resolve(master, socket.AF_UNSPEC):
        return None  # unset, every agent on this host, or an IPv6-only rendezvous
    try:
        if ipaddress.ip_address(master).is_loopback:
            return None
    except ValueError:  # a name
        pass
    try:
        name, why = choose(master)
    except OSError as e:  # no IPv4 sockets at all
        name, why = None, f"cannot list this host's network interfaces ({e})"
    if name is None:
        if say is not None:
            say(f"warning: {why}")
        return None
    env["GLOO_SOCKET_IFNAME"] = name
    if say is not None:
        say(f"gloo between nodes over {name}: {why} (set GLOO_SOCKET_IFNAME to choose another)")
    return name
