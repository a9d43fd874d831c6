"""A SLURM cluster of three hosts on this machine: slurmctld and two slurmd, each in a network namespace of its own
with its own address and hostname, joined by a bridge whose addresses exist only on this machine.

    host (the test process, sbatch/squeue, munged, PostgreSQL on 127.0.0.1)  <bridge> 10.A.B.1
      namespace ctl    10.A.B.10   hostname ctl     slurmctld
      namespace node1  10.A.B.11   hostname node1   slurmd (and every job step it starts)
      namespace node2  10.A.B.12   hostname node2   slurmd

(each namespace's end of the bridge is called fabric0, so one GLOO_SOCKET_IFNAME serves every node).

Each daemon runs under `nsenter --net` (its network namespace) and `unshare --mount --uts`: its own hostname, and
a hosts file naming the three hosts bind-mounted over /etc/hosts in its own mount namespace only (gloo and
Lightning resolve the node names SLURM gives them; the machine's /etc is never written). The namespaces have no
route beyond the bridge's /24, so nothing in them can reach past this machine. munged runs on the host; its
socket is a file, which every namespace sees. `Relay` forwards a TCP port on the bridge address to a server
that listens on 127.0.0.1 only (the suite's PostgreSQL server), so the jobs reach it over an address of theirs.
"""

from __future__ import annotations

import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

NODES = ("node1", "node2")
IFNAME = "fabric0"  # the interface each namespace has on the bridge (GLOO_SOCKET_IFNAME names it)

CONF = """\
ClusterName=attnlabtwo
SlurmctldHost=ctl({prefix}.10)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge/socket
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool_%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd_%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd_%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MpiDefault=none
KillWait=5
SlurmdTimeout={slurmd_timeout}
NodeName=node1 NodeHostname=node1 NodeAddr={prefix}.11 CPUs=1 RealMemory=4000 State=UNKNOWN
NodeName=node2 NodeHostname=node2 NodeAddr={prefix}.12 CPUs=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
# CPUs=1 per node (the machine has 2 cores): a 1-task job fills a node, so two of them run on different nodes.
# SlurmdTimeout (seconds): a node that stops answering for longer is marked DOWN and its jobs requeued. A test module
# sets it (SLURMD_TIMEOUT, default 30): short where a node must go DOWN, long where a stopped node must not.


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def free_subnet() -> str:
    """'10.A.B': a /24 that no interface of this machine uses."""
    used = ip("-o", "-4", "addr").stdout
    rng = random.Random()
    while True:
        prefix = f"10.{rng.randrange(200, 250)}.{rng.randrange(256)}"
        if f" {prefix}." not in used:
            return prefix


class Network:
    """The bridge and three namespaces (ctl, node1, node2), removed by `remove` (which kills what still runs in
    them: job steps the daemons started)."""

    def __init__(self) -> None:
        self.tag = f"{os.getpid() % 10000:04d}{random.randrange(36 ** 2):03x}"[:6]
        self.prefix = free_subnet()
        self.host_addr = f"{self.prefix}.1"
        self.names = {h: f"attnlab-{self.tag}-{h}" for h in ("ctl", *NODES)}
        self.addrs = {"ctl": f"{self.prefix}.10", "node1": f"{self.prefix}.11", "node2": f"{self.prefix}.12"}
        self.bridge = f"al{self.tag}br"
        self.made: list[str] = []

    def create(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self.made.append("bridge")
        ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, (host, ns) in enumerate(self.names.items()):
            ip("netns", "add", ns)
            self.made.append(ns)
            outer, inner = f"al{self.tag}h{i}", f"al{self.tag}c{i}"
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            ip("link", "set", inner, "netns", ns)
            ip("-n", ns, "link", "set", inner, "name", IFNAME)  # one name on every host, as on a real cluster
            ip("link", "set", outer, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.addrs[host]}/24", "dev", IFNAME)
            ip("-n", ns, "link", "set", IFNAME, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def hosts_file(self, path: Path) -> Path:
        path.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in self.addrs.items())
                        + f"{self.host_addr} head\n", encoding="utf-8")
        return path

    def pids(self, host: str) -> list[int]:
        """Every process in a host's network namespace (its daemon and what that started)."""
        r = ip("netns", "pids", self.names[host], check=False)
        return [int(p) for p in r.stdout.split() if p.isdigit()]

    def signal(self, host: str, sig: int) -> list[int]:
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def remove(self) -> None:
        for host, ns in self.names.items():
            if ns in self.made:
                for _ in range(3):  # what the daemons started and left: each by its PID, then the namespace
                    if not self.signal(host, signal.SIGKILL):
                        break
                    time.sleep(0.3)
                ip("netns", "del", ns, check=False)  # its veth end goes with it, and so the pair
        if "bridge" in self.made:
            ip("link", "del", self.bridge, check=False)
        self.made.clear()


def in_namespace(net: Network, host: str, hosts: Path, argv: list[str]) -> list[str]:
    """argv run in host's network namespace, with its hostname and the cluster's hosts file."""
    script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
    return ["nsenter", f"--net=/run/netns/{net.names[host]}", "unshare", "--mount", "--uts", "sh", "-c", script,
            "sh", str(hosts), host, *argv]


class Relay(threading.Thread):
    """Forwards TCP connections made to (listen_host, port) to target, one thread per connection."""

    def __init__(self, listen_host: str, target: tuple[str, int]) -> None:
        super().__init__(daemon=True, name="relay")
        self.target = target
        self.server = socket.create_server((listen_host, 0))
        self.port = self.server.getsockname()[1]
        self.stopped = threading.Event()

    def run(self) -> None:
        self.server.settimeout(0.5)
        while not self.stopped.is_set():
            try:
                conn, _ = self.server.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(self.target, timeout=10)
        except OSError:
            conn.close()
            return
        sel = selectors.DefaultSelector()
        sel.register(conn, selectors.EVENT_READ, up)
        sel.register(up, selectors.EVENT_READ, conn)
        try:
            while not self.stopped.is_set():
                for key, _ in sel.select(timeout=0.5):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            conn.close()
            up.close()

    def stop(self) -> None:
        self.stopped.set()
        self.server.close()


def can_make_namespaces() -> str | None:
    """None when this process can make network namespaces and bridges; else why not, in words."""
    if not os.uname().sysname == "Linux":
        return "network namespaces exist on Linux only"
    if os.geteuid() != 0:
        return "this user is not root, so it cannot make network namespaces"
    missing = [b for b in ("ip", "nsenter", "unshare", "mount") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not found (iproute2, util-linux)"
    return None
