"""A private Slurm cluster on this machine: munged, slurmctld and two slurmd (nodes n1, n2).

Everything lives in one temporary directory (config, state, spool, logs, munge key and socket);
the daemons run in the foreground as our child processes and are stopped by ``stop()``. Both
nodes are this host (``NodeAddr=127.0.0.1``, a port each, each slurmd started with ``-N``), so
a 2-node job runs its tasks here with the environment Slurm gives on a real cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def missing() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None]


def install() -> str | None:
    """Install Debian's slurm-wlm and munge; None on success, else why not."""
    if os.geteuid() != 0:
        return f"slurm daemons missing ({', '.join(missing())}) and not root: cannot install"
    if shutil.which("apt-get") is None:
        return f"slurm daemons missing ({', '.join(missing())}) and no apt-get to install them"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]
    for cmd in (["apt-get", "update", "-qq"], install):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
            return f"`{' '.join(cmd)}` failed: {tail[0]}"
    return None if not missing() else f"still missing after install: {', '.join(missing())}"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Cluster:
    def __init__(self, root: str, nodes=("n1", "n2"), cpus: int = 2):
        self.root, self.nodes, self.cpus = root, nodes, cpus
        self.procs: list[subprocess.Popen] = []
        self.conf = os.path.join(root, "slurm.conf")
        launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("SLURM_") and k not in launcher}  # fmt: skip
        self.env["SLURM_CONF"] = self.conf

    # ---- start / stop --------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        for d in ("state", "spool", "log", "munge"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        os.chmod(os.path.join(self.root, "munge"), 0o700)
        self._start_munged()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        for n in self.nodes:
            self._spawn(f"slurmd.{n}", ["slurmd", "-D", "-N", n])
        self._wait_idle(timeout)

    def _start_munged(self) -> None:
        m = os.path.join(self.root, "munge")
        key = os.path.join(m, "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        os.write(fd, os.urandom(1024))
        os.close(fd)
        self.munge_socket = os.path.join(m, "munge.socket")
        self._spawn(
            "munged",
            ["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--log-file={m}/munged.log", f"--pid-file={m}/munged.pid",
             f"--seed-file={m}/munged.seed"],
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not os.path.exists(self.munge_socket):
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start: {self._tail('munge/munged.log')}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        ctld, *ports = _free_ports(1 + len(self.nodes))
        r = self.root
        lines = [
            "ClusterName=megafp8test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld}",
            "AuthType=auth/munge",
            # cred_expire: a requeued job waits this long before it may start again (default 120)
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc",  # no cgroups needed
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "JobRequeue=1",
            "MinJobAge=600",
        ]
        for n, port in zip(self.nodes, ports, strict=True):
            lines.append(
                f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus} State=UNKNOWN"
            )
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")  # fmt: skip
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(os.path.join(self.root, "log", f"{name}.stdout"), "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT))

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited: {self._tail('log/slurmctld.log')}")
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = r.stdout.strip()
            got = dict(line.split() for line in states.splitlines() if line.strip())
            if all(got.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle after {timeout:.0f} s: {states!r}")

    def stop(self) -> None:
        """Cancel every job, then stop the daemons we started (newest first)."""
        if any(p.poll() is None for p in self.procs):
            self.run("scancel", "--user=root", check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout:
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    def _tail(self, rel: str, n: int = 5) -> str:
        try:
            with open(os.path.join(self.root, rel)) as f:
                return " | ".join(f.read().strip().splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ---- jobs ----------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, env: dict | None = None, cwd=None, timeout=600):
        r = subprocess.run(
            list(cmd), env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} -> {r.returncode}: {r.stderr.strip()}")
        return r

    def job(self, job_id: str) -> dict:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float = 300.0) -> dict:
        """Poll until the job is finished (a requeued job is not: it runs again)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in TERMINAL:
                return info
            time.sleep(0.5)
        state = self.job(job_id).get("JobState")
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")
