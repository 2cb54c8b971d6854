"""Emulated hosts: Linux network namespaces joined by bandwidth-limited veths.

`Network(n)` creates `n` "host" namespaces and one "switch" namespace
holding a bridge; host `i` reaches the switch through a veth pair and owns
the address `10.77.<net>.<i + 1>/24` on its end (`eth0`). With `rate`
(e.g. `"1gbit"`, `"100mbit"`), both ends of every veth get a `tc tbf`
qdisc, so each host sends and receives at most `rate`, as through a
network card of that speed (`netem` is not needed, and not available on
every kernel). Every interface and address lives inside namespaces the
object created; nothing is added to the caller's own namespace, and
`close()` (or leaving the `with` block) deletes all of it.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip`/`tc` from iproute2;
`unavailable()` says why not, for tests to skip with that reason.

Example:

```python
from benchmarks import netns

with netns.Network(2, rate="100mbit") as net:
    procs = [net.popen(i, ["python", "worker.py", net.addresses[i]])
             for i in range(2)]
```
"""

import os
import shutil
import subprocess
import uuid

_TIMEOUT = 20


def _run(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True,
                          timeout=_TIMEOUT, check=check)


def unavailable():
    """Why namespaces cannot be made here, or None when they can."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"kmprobe{uuid.uuid4().hex[:8]}"
    try:
        made = _run("ip", "netns", "add", name, check=False)
        if made.returncode != 0:
            return ("`ip netns add` failed: "
                    f"{made.stderr.strip() or made.returncode}")
        link = _run("ip", "-n", name, "link", "add", "kmprobe0", "type", "veth",
                    "peer", "name", "kmprobe1", check=False)
        if link.returncode != 0:
            return f"cannot create a veth pair: {link.stderr.strip()}"
        tbf = _run("tc", "-n", name, "qdisc", "add", "dev", "kmprobe0", "root",
                   "tbf", "rate", "100mbit", "burst", "128kb", "latency",
                   "100ms", check=False)
        if tbf.returncode != 0:
            return f"`tc ... tbf` failed: {tbf.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run iproute2: {e}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


def bytes_per_second(rate):
    """`rate` (tc syntax, e.g. `"100mbit"`) in bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale / 8
    raise ValueError(
        "`rate` must be a number followed by gbit, mbit or kbit. "
        f"Received: rate={rate!r}")


class Network:
    """`n` emulated hosts on one switch, each link limited to `rate`.

    Args:
        n: int. Number of hosts (namespaces with one address each).
        rate: str or None. tc rate of every link in each direction, e.g.
            `"1gbit"`; None leaves the links unshaped (veth speed).
        net: int. Third octet of the hosts' `10.77.<net>.0/24` subnet;
            default 0 (the subnet exists only inside these namespaces).
    """

    def __init__(self, n, rate=None, net=0):
        if rate is not None:
            bytes_per_second(rate)
        self.n = n
        self.rate = rate
        tag = uuid.uuid4().hex[:8]
        self.hosts = [f"km{tag}h{i}" for i in range(n)]
        self.switch = f"km{tag}sw"
        self.addresses = [f"10.77.{net}.{i + 1}" for i in range(n)]
        self._made = []

    @property
    def bytes_per_second(self):
        """The link rate in bytes per second, or None when unshaped."""
        return None if self.rate is None else bytes_per_second(self.rate)

    def __enter__(self):
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def open(self):
        for ns in [self.switch] + self.hosts:
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        sw = self.switch
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            port = f"p{i}"
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth",
                 "peer", "name", port, "netns", sw)
            _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24",
                 "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", sw, "link", "set", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", port, "up")
        self.set_rate(self.rate)

    def set_rate(self, rate):
        """Shapes every link to `rate` (None removes the shaping)."""
        self.rate = rate
        links = [(ns, "eth0") for ns in self.hosts] + [
            (self.switch, f"p{i}") for i in range(self.n)]
        for ns, dev in links:
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root",
                 check=False)
            if rate is None:
                continue
            # A burst of at least a few GSO packets (veth sends up to 64 KB
            # at once) and about 2 ms of traffic; queued bytes beyond
            # `latency` are dropped and TCP backs off, as on a real link.
            burst = max(256 * 1024, int(bytes_per_second(rate) / 500))
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                 "rate", rate, "burst", str(burst), "latency", "200ms")

    def command(self, host, cmd):
        """`cmd` (a list) prefixed to run inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host], *cmd]

    def popen(self, host, cmd, **kwargs):
        """Starts `cmd` inside host `host`; `subprocess.Popen` kwargs."""
        return subprocess.Popen(self.command(host, cmd), **kwargs)

    def close(self):
        """Deletes every namespace made (their veths and qdiscs go too)."""
        while self._made:
            _run("ip", "netns", "del", self._made.pop(), check=False)
