"""A command run as a child process and measured from launch to exit: wall and CPU seconds, the
peak RSS of its largest process (os.wait4) and the peak over time of the RSS and PSS summed
over its whole process tree (sampled from /proc; the figures are defined in
benchmarks/large_corpus.py's docstring). Used by large_corpus.py, data_store.py and
shared_store.py.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the commands run from the repository root


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # fields after "(comm)": state, ppid
            out.setdefault(ppid, []).append(int(entry))
    return out


def _rss_pss_kb(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


class TreeSampler(threading.Thread):
    """Peak over time of the summed RSS and PSS of a process and all its descendants."""

    def __init__(self, pid: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss_kb = self.peak_pss_kb = self.max_processes = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            children, tree, stack = _children_map(), [], [self.pid]
            while stack:
                pid = stack.pop()
                tree.append(pid)
                stack += children.get(pid, [])
            sizes = [_rss_pss_kb(pid) for pid in tree]
            self.peak_rss_kb = max(self.peak_rss_kb, sum(r for r, _ in sizes))
            self.peak_pss_kb = max(self.peak_pss_kb, sum(p for _, p in sizes))
            self.max_processes = max(self.max_processes, len(tree))
            self.done.wait(self.interval)


def measure(cmd: list[str], log: Path, env: dict, mb: float) -> dict:
    """Run `cmd` to completion with stdout + stderr into `log`; wall, CPU and memory figures."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (and its reaped workers')
        wall = time.perf_counter() - t0
        sampler.done.set()
        sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "wall_s": round(wall, 2),
        "mb_per_s": round(mb / wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 3),
        "tree_rss_gb": round(sampler.peak_rss_kb * 1024 / 1e9, 3),
        "tree_pss_gb": round(sampler.peak_pss_kb * 1024 / 1e9, 3),
        "max_processes": sampler.max_processes,
        "output": log.read_text("utf-8", "replace"),
    }
