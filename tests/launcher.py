"""The processes of the distributed tests' jobs, forked from one that imported everything once.

A Python process that starts from nothing spends seconds of CPU importing torch, Lightning and
lit_transformer, and a 2-process job that Lightning launches starts two of them one after the
other: rank 1 only once rank 0 reaches its first fit, which then waits for it. RankLauncher is
one process per test session (conftest.py's `launcher` fixture) that imports them once and, for
each job, forks its ranks: both start at once, as torchrun starts them (LOCAL_RANK, NODE_RANK and
WORLD_SIZE set, so Lightning starts no process itself). That is also how every run after the
first finds its ranks in a job that Lightning launched: rank 0 then holds the variables its
launcher set. helpers.run_two_ranks keeps Lightning's own launcher for one test (test_objective_training.py).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers import free_port, job_env


class RankLauncher:
    """The forking process: started here, it imports while the caller goes on (its first job waits
    for the imports); `run` hands it a job and waits for the job's ranks; `close` ends it."""

    def __init__(self):
        self.errors = tempfile.TemporaryFile()  # what the launcher itself says: shown if it dies
        self._start()

    def _start(self) -> None:
        # the imports read the environment the jobs share (threads, hub access, warning filters)
        env = job_env(Path(tempfile.gettempdir()), 0)
        command = [sys.executable, "-c", "import launcher; launcher.serve()"]
        pipe = subprocess.PIPE
        self.server = subprocess.Popen(command, stdin=pipe, stdout=pipe, stderr=self.errors, text=True, env=env)

    def run(self, script: Path, args: list[str], cache: Path, cwd: Path, timeout: int, ranks: int = 2) -> None:
        """Run `script` with `args` in `cwd` as a gloo job of `ranks` processes (1 or 2) on this
        machine, with the token cache `cache`, as `python script args` would run in each. A rank
        that waits on a collective the other never enters hangs: at the timeout the ranks are
        killed and the job fails, with each failed rank's output."""
        if self.server.poll() is not None:  # an earlier job killed it (see below)
            self._start()
        with tempfile.TemporaryDirectory() as logs:
            job = dict(script=str(script), args=[str(a) for a in args], cwd=str(cwd), logs=logs, ranks=ranks)
            job.update(env=job_env(cache, free_port()), timeout=timeout)
            self.server.stdin.write(json.dumps(job) + "\n")
            self.server.stdin.flush()
            # the imports, then the job (killed at its timeout): no answer by then is a dead launcher
            answered, _, _ = select.select([self.server.stdout], [], [], timeout + 120)
            line = self.server.stdout.readline() if answered else ""
            if not line:
                self.server.kill()
                self.errors.seek(0)
                said = self.errors.read().decode(errors="replace")[-4000:]
                raise AssertionError(f"the rank launcher did not answer (exit status {self.server.wait()}):\n{said}")
            codes = json.loads(line)
            output = [(Path(logs) / f"rank{rank}.log").read_text(errors="replace") for rank in range(ranks)]
        said = [f"rank {r} exited with {code}:\n{output[r][-4000:]}" for r, code in enumerate(codes) if code != 0]
        assert not said, "\n".join(said)

    def close(self) -> None:
        self.server.stdin.close()  # the launcher's loop ends at the end of its input
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:  # still waiting for a job (an interrupted test session)
            self.server.kill()
        self.errors.close()


def serve() -> None:
    """The launcher's process: import once, then for each job (a JSON line) fork its ranks, wait
    for them (killing them at the job's timeout) and answer their exit statuses (a JSON line)."""
    import gc
    import threading
    import time

    # what the jobs run, imported once here; not W&B, whose import makes a folder for its media
    # that the first rank to exit removes (the next job's runs then fail to log their samples)
    import lit_transformer.commands.cli  # noqa: F401
    import lit_transformer.commands.train  # noqa: F401

    gc.freeze()  # the imported objects stay out of the ranks' collections: fewer pages copied
    for line in sys.stdin:
        job = json.loads(line)
        # fork copies only the calling thread: an import that started one would leave it out
        tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]
        assert threading.active_count() == 1 and len(tasks) == 1, "a thread started in the launcher"
        pids = [_fork_rank(job, rank) for rank in range(job["ranks"])]
        deadline, codes = time.monotonic() + job["timeout"], {}
        try:
            while len(codes) < len(pids):
                for pid in set(pids) - set(codes):
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
                    elif time.monotonic() > deadline:
                        _kill(pid)
                time.sleep(0.02)
        except BaseException:  # an interrupted session: its ranks go with the launcher
            for pid in set(pids) - set(codes):
                _kill(pid)
            raise
        print(json.dumps([codes[pid] for pid in pids]), flush=True)


def _kill(pid: int) -> None:
    """The rank `pid` and what it started (its session)."""
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not yet its own session, or gone
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fork_rank(job: dict, rank: int) -> int:
    """In the launcher: the forked rank's pid. In the fork: become `python script args` of that
    rank (its environment, folder, arguments, path and output) and exit as that process would."""
    pid = os.fork()
    if pid:
        return pid
    os.setsid()  # its own session: a timeout kills the rank with whatever it started
    log = os.open(Path(job["logs"]) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(job["env"])
    if job["ranks"] > 1:  # what Lightning's launcher sets for the processes of one node
        os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(job["ranks"]))
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0  # as Lightning's import sets it from the environment
    os.chdir(job["cwd"])
    sys.argv = [job["script"], *job["args"]]
    sys.path[0] = str(Path(job["script"]).parent)
    import runpy

    runpy.run_path(job["script"], run_name="__main__")
    sys.exit(0)  # up through the launcher's frames: the interpreter exits as the script's would
