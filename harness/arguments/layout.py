"""Where a run's ranks are, from the command line: the hosts (--hosts or --hostfile, read once), the
rendezvous (--master), the nodes, the ranks per node and this node's rank (harness.run.nodes says how the
nodes of a run agree)."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from harness.usage import UsageError

DEFAULT_MASTER_PORT = 29500  # torchrun's default, for multi-node runs given no port


def read_hosts(args) -> tuple[list[str], int | None]:
    """Host names from --hosts or --hostfile, and the hostfile's slots per host (None if it gives none)."""
    if getattr(args, "hosts", None):
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        if not hosts:
            raise UsageError("--hosts: expected comma-separated host names")
        return hosts, None
    if not getattr(args, "hostfile", None):
        return [], None
    try:
        lines = Path(args.hostfile).read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"--hostfile {args.hostfile}: {exc.strerror}") from None
    hosts, slots = [], set()
    for line in (ln.split("#", 1)[0].strip() for ln in lines):
        if not line:
            continue
        m = re.fullmatch(r"([^\s:]+)(?::(\d+)|\s+slots\s*=\s*(\d+))?(?:\s+.*)?", line)
        if not m:
            raise UsageError(
                f"--hostfile {args.hostfile}: cannot read line '{line}'; expected 'host', "
                "'host slots=G' or 'host:G'"
            )
        hosts.append(m.group(1))
        if m.group(2) or m.group(3):
            slots.add(int(m.group(2) or m.group(3)))
    if not hosts:
        raise UsageError(f"--hostfile {args.hostfile}: no hosts in it")
    if len(slots) > 1:
        raise UsageError(f"--hostfile {args.hostfile}: every node needs the same slots, got {sorted(slots)}")
    return hosts, slots.pop() if slots else None


def parse_master(text: str | None) -> tuple[str | None, int | None]:
    if not text:
        return None, None
    addr, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not addr or (port and not (port.isdigit() and 0 < int(port) < 65536)):
        raise UsageError(f"--master {text}: expected ADDR or ADDR:PORT with a port in 1..65535")
    return addr, int(port) if port else None


def this_node_rank(hosts: list[str]) -> int:
    """This host's index in `hosts`, when it appears there exactly once."""
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    found = [i for i, h in enumerate(hosts) if h in names]
    if len(found) != 1:
        raise UsageError(
            f"give --node-rank: this host ({socket.gethostname()}) is "
            f"{'not' if not found else 'more than once'} in the hosts {','.join(hosts)}"
        )
    return found[0]


def default_master(hosts: list[str], nodes: int) -> tuple[str, int | None]:
    """Where the ranks meet when --master is not given: the first host (torchrun's port) across nodes,
    this machine on one node (the harness then picks a free port per run)."""
    if nodes > 1:
        return hosts[0] if hosts else "127.0.0.1", DEFAULT_MASTER_PORT
    return "127.0.0.1", None


@dataclass(frozen=True)
class Layout:
    """The multi-node flags as given (--nodes, --gpus-per-node, --node-rank), with the hosts and the
    rendezvous read once."""

    nodes: int | None
    per_node: int | None
    node_rank: int | None
    hosts: list[str]
    slots: int | None
    master: tuple[str | None, int | None]

    @classmethod
    def read(cls, args) -> Layout:
        hosts, slots = read_hosts(args)
        return cls(
            nodes=getattr(args, "nodes", None),
            per_node=getattr(args, "gpus_per_node", None),
            node_rank=getattr(args, "node_rank", None),
            hosts=hosts,
            slots=slots,
            master=parse_master(getattr(args, "master", None)),
        )

    def world(self, gpus: int | None) -> int:
        """Ranks in all: --gpus, else nodes x ranks per node."""
        return gpus or (self.nodes or len(self.hosts) or 1) * (self.per_node or self.slots or 1)

    def settings(self, world: int, node_rank: int | None = None) -> dict:
        """RunConfig's multi-node settings, checked: every node must be given the same layout."""
        nodes = self.nodes or len(self.hosts) or 1
        if self.hosts and len(self.hosts) != nodes:
            raise UsageError(f"--nodes {nodes} but {len(self.hosts)} host(s) given")
        per_node = self.per_node or self.slots
        if per_node and per_node * nodes != world:
            raise UsageError(f"{world} ranks but {nodes} node(s) x {per_node} per node = {nodes * per_node}")
        if world % nodes:
            raise UsageError(f"{world} ranks do not split evenly over {nodes} nodes")
        addr, port = self.master
        if node_rank is None:
            node_rank = self.node_rank
        if node_rank is None:
            node_rank = this_node_rank(self.hosts) if nodes > 1 else 0
        if not 0 <= node_rank < nodes:
            raise UsageError(f"--node-rank {node_rank}: expected 0..{nodes - 1} for {nodes} node(s)")
        if nodes > 1 and not (addr or self.hosts):
            raise UsageError(
                f"--nodes {nodes}: give --master ADDR[:PORT] or the hosts, so the nodes can meet"
            )
        default_addr, default_port = default_master(self.hosts, nodes)
        return {
            "nodes": nodes,
            "gpus_per_node": world // nodes,
            "node_rank": node_rank,
            "hosts": self.hosts,
            "master_addr": addr or default_addr,
            "master_port": port or default_port,
        }


def requested_world(args) -> int:
    """Ranks in all: --gpus, else nodes x ranks per node."""
    return Layout.read(args).world(getattr(args, "gpus", None))
