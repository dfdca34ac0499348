"""Model services as hosts behind a network link, on one machine: each in a Linux network namespace of
its own, joined to this one by a veth pair whose two ends can be rate-limited with `tbf` (one qdisc
per direction: this kernel has tbf and htb, not netem). Needs root and iproute2; `bench.link` uses it.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

# tbf's bucket: at least a few 64 KiB segments (veth passes GSO segments whole), and a few
# milliseconds' worth at the rate, so that the shaper, not the bucket, sets the rate.
_MIN_BURST_BYTES = 256 * 1024
_BURST_SECONDS = 0.004
_QUEUE_LATENCY = "100ms"
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def rate_bits(rate: str) -> int:
    """'1gbit' -> 10^9, '100mbit' -> 10^8 (tc's units); raises ValueError naming the form expected."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"a link rate is a number and kbit, mbit or gbit, such as 1gbit; got {rate!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Host:
    """One namespace: its address, reachable from this namespace over its veth pair."""

    namespace: str
    address: str
    outer_end: str  # the veth end in this namespace (shapes what this side sends)
    inner_end: str  # the end inside the namespace (shapes what the host sends)


@dataclass
class Hosts:
    """A context manager: one namespace per role, removed on exit however it ends."""

    roles: Sequence[str]
    subnet: int = 232  # hosts get 10.<subnet>.<n>.2, this side 10.<subnet>.<n>.1
    hosts: dict[str, Host] = field(default_factory=dict)

    def __enter__(self) -> Hosts:
        tag = uuid.uuid4().hex[:5]
        try:
            for number, role in enumerate(self.roles, start=1):
                host = Host(
                    f"sd{role[:3]}{tag}", f"10.{self.subnet}.{number}.2", f"o{role[:3]}{tag}", f"i{role[:3]}{tag}"
                )
                _run("ip", "netns", "add", host.namespace)
                self.hosts[role] = host
                _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
                _run("ip", "link", "add", host.outer_end, "type", "veth", "peer", "name", host.inner_end)
                _run("ip", "link", "set", host.inner_end, "netns", host.namespace)
                _run("ip", "addr", "add", f"10.{self.subnet}.{number}.1/30", "dev", host.outer_end)
                _run("ip", "link", "set", host.outer_end, "up")
                _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/30", "dev", host.inner_end)
                _run("ip", "-n", host.namespace, "link", "set", host.inner_end, "up")
        except BaseException:
            self.remove()
            raise
        return self

    def command(self, role: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the role's namespace."""
        return ["ip", "netns", "exec", self.hosts[role].namespace, *argv]

    def shape(self, rate: str | None) -> None:
        """Limit every link to `rate` in both directions (None: unlimited)."""
        for host in self.hosts.values():
            for namespace, end in ((None, host.outer_end), (host.namespace, host.inner_end)):
                prefix = ["ip", "netns", "exec", namespace] if namespace else []
                if rate is None:
                    subprocess.run([*prefix, "tc", "qdisc", "del", "dev", end, "root"], capture_output=True)
                    continue
                burst = max(_MIN_BURST_BYTES, int(rate_bits(rate) / 8 * _BURST_SECONDS))
                _run(*prefix, "tc", "qdisc", "replace", "dev", end, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", _QUEUE_LATENCY)  # fmt: skip

    def remove(self) -> None:
        """Delete the namespaces (their veth pairs go with them)."""
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        self.hosts.clear()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.remove()
