"""Separate network hosts on this one machine, for the multi-node tests.

Each host is a Linux network namespace with one veth interface and its own address, plugged into a
bridge in the root namespace (which has the bridge's address: the "login node" the SLURM controller
and the tests' clients run on). Commands started through :meth:`Hosts.prefix` also get their own
hostname (a UTS namespace), their own ``/dev/shm`` and an ``/etc/hosts`` of their own (a mount
namespace; ``/etc/netns/NAME/hosts`` bound over it), as separate machines have.

The hosts files are written as Debian's installer writes them: a host's own name maps to
``127.0.1.1``, the other hosts' names to their addresses. Software that trusts its own hostname
to find its network address (gloo does) therefore gets loopback, as on many real clusters.

Addresses are link-local (``169.254.N.0/24``, a subnet no interface here uses): they are never
routed, and no host has a default route, so nothing leaves the machine. Everything is named
``longsft<pid>...`` and removed by :meth:`Hosts.close`; what a killed test run left behind is removed
by the next :func:`create`. Needs root and ``ip`` (iproute2) and ``unshare`` (util-linux).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ETC_NETNS = Path("/etc/netns")


def unavailable() -> str | None:
    """Why separate network hosts cannot be made here, or None."""
    missing = [b for b in ("ip", "nsenter", "unshare", "mount") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install -y iproute2 util-linux mount"
    if os.geteuid() != 0:
        return "network namespaces need root; these tests run as a normal user"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


@dataclass
class Host:
    name: str  # hostname (and SLURM NodeName)
    netns: str
    addr: str
    iface: str  # its one non-loopback interface, inside the namespace


@dataclass
class Hosts:
    tag: str  # longsft<pid>: every name made here starts with it
    bridge: str
    gateway: str  # the bridge's address (the root namespace)
    hosts: list[Host] = field(default_factory=list)

    def prefix(self, host: Host) -> list[str]:
        """A command line prefix that runs a program on ``host`` (its network, hostname, /dev/shm)."""
        # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup filesystem slurmd needs
        setup = (f"hostname {host.name} && mount --bind {ETC_NETNS / host.netns / 'hosts'} /etc/hosts && "
                 "mount -t tmpfs -o size=1g tmpfs /dev/shm && exec \"$@\"")
        return ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "--mount", "--propagation",
                "private", "sh", "-c", setup, "sh"]

    def host_of(self, pid: int) -> Host | None:
        """The host whose network namespace process ``pid`` lives in (None: the root namespace)."""
        r = _ip("netns", "identify", str(pid), check=False)
        name = r.stdout.strip()
        return next((h for h in self.hosts if h.netns == name), None)

    def close(self) -> None:
        _remove(self.tag)


def _remove(tag: str) -> None:
    for ns in _ip("netns", "list", check=False).stdout.split():
        if ns.startswith(tag + "-"):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"\d+: ([^:@]+)", line)
        if m and m.group(1).startswith(tag):
            _ip("link", "del", m.group(1), check=False)


def _remove_stale() -> None:
    """Hosts of a test run whose process is gone (killed before its teardown)."""
    tags = set()
    for ns in _ip("netns", "list", check=False).stdout.split():
        m = re.match(r"(longsft(\d+))-", ns)
        if m and not Path(f"/proc/{m.group(2)}").exists():
            tags.add(m.group(1))
    for tag in tags:
        _remove(tag)


def _free_subnet() -> ipaddress.IPv4Network:
    used = [ipaddress.ip_interface(a).network for a in
            re.findall(r"inet (\S+)", _ip("-o", "-4", "addr", "show", check=False).stdout)]
    for third in range(200, 250):
        net = ipaddress.ip_network(f"169.254.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 169.254.N.0/24 subnet for the test hosts")


def create(names: list[str]) -> Hosts:
    """Make one host per name (``names[i]`` gets address ``.11 + i``) on a fresh bridge."""
    _remove_stale()
    tag = f"longsft{os.getpid()}"
    net = _free_subnet()
    gateway = str(net.network_address + 1)
    hosts = Hosts(tag, bridge=f"{tag}b", gateway=gateway)
    try:
        _ip("link", "add", hosts.bridge, "type", "bridge")
        _ip("addr", "add", f"{gateway}/{net.prefixlen}", "dev", hosts.bridge)
        _ip("link", "set", hosts.bridge, "up")
        for i, name in enumerate(names):
            h = Host(name, netns=f"{tag}-{name}", addr=str(net.network_address + 11 + i), iface="eth0")
            outside = f"{tag}v{i}"
            _ip("netns", "add", h.netns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", f"{tag}p{i}")
            _ip("link", "set", f"{tag}p{i}", "netns", h.netns)
            _ip("-n", h.netns, "link", "set", f"{tag}p{i}", "name", h.iface)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/{net.prefixlen}", "dev", h.iface)
            _ip("-n", h.netns, "link", "set", h.iface, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("link", "set", outside, "master", hosts.bridge)
            _ip("link", "set", outside, "up")
            hosts.hosts.append(h)
        for h in hosts.hosts:
            lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{h.name}"]
            lines += [f"{o.addr}\t{o.name}" for o in hosts.hosts if o is not h]
            (ETC_NETNS / h.netns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / h.netns / "hosts").write_text("\n".join(lines) + "\n")
    except BaseException:
        hosts.close()
        raise
    return hosts
