"""Separate network hosts on this one machine, for the multi-node tests.

Each host is a Linux network namespace with one veth interface and its own address, plugged into a
bridge in the root namespace (which has the bridge's address: the "login node" the SLURM controller
and the tests' clients run on). Commands started through :meth:`Hosts.prefix` also get their own
hostname (a UTS namespace), their own ``/dev/shm`` and an ``/etc/hosts`` of their own (a mount
namespace; a file in the caller's folder bound over it), as separate machines have.

The hosts files are written as Debian's installer writes them: a host's own name maps to
``127.0.1.1``, the other hosts' names to their addresses. Software that trusts its own hostname
to find its network address (gloo does) therefore gets loopback, as on many real clusters.

Addresses are link-local (``169.254.N.0/24``, a subnet no interface here uses): they are never
routed, and no host has a default route, so nothing leaves the machine. Namespaces are named
``longsft<pid>-<host>``, interfaces ``ls<pid>`` plus a letter and number (15 characters at most);
:meth:`Hosts.close` removes them all, and what a killed test run left behind is removed by the
next :func:`create`. Nothing outside the caller's folder is written. Needs root (with the
capabilities to make namespaces), ``ip`` (iproute2), ``nsenter`` and ``unshare`` (util-linux).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def unavailable() -> str | None:
    """Why separate network hosts cannot be made here, or None."""
    missing = [b for b in ("ip", "nsenter", "unshare", "mount") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install -y iproute2 util-linux mount"
    if os.geteuid() != 0:
        return "network namespaces need root; these tests run as a normal user"
    r = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make namespaces here (a container without CAP_SYS_ADMIN?): {r.stderr.strip()}"
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
    hosts_file: Path  # bound over its /etc/hosts


@dataclass
class Hosts:
    pid: int  # of the test process that made them: every name made here carries it
    bridge: str
    gateway: str  # the bridge's address (the root namespace)
    hosts: list[Host] = field(default_factory=list)

    def prefix(self, host: Host) -> list[str]:
        """A command line prefix that runs a program on ``host`` (its network, hostname, /dev/shm)."""
        # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup filesystem slurmd needs
        setup = (f"hostname {host.name} && mount --bind {host.hosts_file} /etc/hosts && "
                 "mount -t tmpfs -o size=1g tmpfs /dev/shm && exec \"$@\"")
        return ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "--mount", "--propagation",
                "private", "sh", "-c", setup, "sh"]

    def host_of(self, pid: int) -> Host | None:
        """The host whose network namespace process ``pid`` lives in (None: the root namespace)."""
        r = _ip("netns", "identify", str(pid), check=False)
        name = r.stdout.strip()
        return next((h for h in self.hosts if h.netns == name), None)

    def close(self) -> None:
        _remove(self.pid)


def _netns(pid: int, name: str) -> str:
    return f"longsft{pid}-{name}"


def _link(pid: int, kind: str, i: int | str = "") -> str:
    return f"ls{pid}{kind}{i}"  # kind: b(ridge), v(eth outside), p(eer, renamed eth0 inside)


def _remove(pid: int) -> None:
    for ns in _ip("netns", "list", check=False).stdout.split():
        if ns.startswith(_netns(pid, "")):
            _ip("netns", "del", ns, check=False)
    ours = re.compile(rf"ls{pid}[bvp]\d*")
    for name in re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link", "show", check=False).stdout, re.MULTILINE):
        if ours.fullmatch(name):
            _ip("link", "del", name, check=False)


def _remove_stale() -> None:
    """Hosts of a test run whose process is gone (killed before its teardown)."""
    pids = {int(m.group(1)) for ns in _ip("netns", "list", check=False).stdout.split()
            if (m := re.match(r"longsft(\d+)-", ns))}
    pids |= {int(p) for p in re.findall(r"^\d+: ls(\d+)[bvp]\d*[:@]", _ip("-o", "link", "show", check=False).stdout,
                                        re.MULTILINE)}
    for pid in pids:
        if not Path(f"/proc/{pid}").exists():
            _remove(pid)


def _free_subnet() -> ipaddress.IPv4Network:
    used = [ipaddress.ip_interface(a).network for a in
            re.findall(r"inet (\S+)", _ip("-o", "-4", "addr", "show", check=False).stdout)]
    for third in range(200, 250):
        net = ipaddress.ip_network(f"169.254.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 169.254.N.0/24 subnet for the test hosts")


def create(names: list[str], folder: Path) -> Hosts:
    """Make one host per name (``names[i]`` gets address ``.11 + i``) on a fresh bridge; their hosts
    files go in ``folder``."""
    _remove_stale()
    pid = os.getpid()
    net = _free_subnet()
    gateway = str(net.network_address + 1)
    hosts = Hosts(pid, bridge=_link(pid, "b"), gateway=gateway)
    try:
        _ip("link", "add", hosts.bridge, "type", "bridge")
        _ip("addr", "add", f"{gateway}/{net.prefixlen}", "dev", hosts.bridge)
        _ip("link", "set", hosts.bridge, "up")
        for i, name in enumerate(names):
            h = Host(name, netns=_netns(pid, name), addr=str(net.network_address + 11 + i), iface="eth0",
                     hosts_file=folder / f"hosts.{name}")
            outside, peer = _link(pid, "v", i), _link(pid, "p", i)
            _ip("netns", "add", h.netns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", h.netns)
            _ip("-n", h.netns, "link", "set", peer, "name", h.iface)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/{net.prefixlen}", "dev", h.iface)
            _ip("-n", h.netns, "link", "set", h.iface, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("link", "set", outside, "master", hosts.bridge)
            _ip("link", "set", outside, "up")
            hosts.hosts.append(h)
        for h in hosts.hosts:
            lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{h.name}"]
            lines += [f"{o.addr}\t{o.name}" for o in hosts.hosts if o is not h]
            h.hosts_file.write_text("\n".join(lines) + "\n")
    except BaseException:
        hosts.close()
        raise
    return hosts
