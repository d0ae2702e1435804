"""Ranks 1..W-1 as child processes of rank 0 on one machine: started, watched, stopped, and the
sentence that says how one ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from brisk.engine.workers.args import WorkerArgs


# A worker's exit code when another rank went away first (rank 0 blames that one, not this one).
LOST_GROUP = 3


def _stopped(proc: subprocess.Popen[bytes]) -> bool:
    """True for a live process the kernel holds stopped (Linux /proc; False where unknown)."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return False
    return proc.poll() is None and stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def threads_per_rank(local_world: int) -> int:
    return max(1, (os.cpu_count() or 1) // local_world)


class WorkerSet:
    """Ranks 1..W-1 as child processes on this machine; says how one ended when a step fails."""

    def __init__(self, args: WorkerArgs, port: int) -> None:
        """`port`: rank 0's store (see groups.local_store)."""
        world = args.parallel.world_size
        self.timeout_s = args.timeout_s
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(world)), "LOCAL_WORLD_SIZE": str(world)}
        # Own sessions: a Ctrl-C in the terminal reaches rank 0 alone, which stops the workers in
        # order (they also exit if rank 0 disappears, see _exit_with_parent).
        self.procs = {
            rank: subprocess.Popen([sys.executable, "-m", "brisk.engine.workers",
                                    json.dumps({"rank": rank, "port": port, "args": asdict(args)})],
                                   env={**env, "LOCAL_RANK": str(rank)}, start_new_session=True)
            for rank in range(1, world)
        }

    def describe(self, error: BaseException) -> str:
        """Which worker failed and how; the others are stopped (they cannot go on without it).
        Workers that merely lost the group after another failed exit with LOST_GROUP and are not
        blamed."""
        deadline = time.monotonic() + 3.0  # a killed peer's exit status appears within moments
        while True:
            blamed = [self._ending(rank, p) for rank, p in self.procs.items()
                      if p.poll() is not None and p.returncode != LOST_GROUP]
            blamed += [f"worker rank {rank} (pid {p.pid}) is stopped (SIGSTOP or a debugger) and did not answer "
                       f"within {self.timeout_s:g} s" for rank, p in self.procs.items() if _stopped(p)]
            if blamed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.stop(grace_s=1.0)
        if blamed:
            return f"parallel engine stopped: {'; '.join(blamed)} ({error})"
        return (f"parallel engine stopped: a worker did not answer within {self.timeout_s:g} s (hung, or the "
                f"machine is overloaded; raise timeout_s if steps are that slow): {error}")

    def poll(self) -> str | None:
        """Between steps: a sentence about a worker that has ended, or None while all run."""
        ended = [self._ending(rank, p) for rank, p in self.procs.items() if p.poll() is not None]
        if not ended:
            return None
        self.stop(grace_s=1.0)
        return f"parallel engine stopped: {'; '.join(ended)}"

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    @staticmethod
    def _ending(rank: int, proc: subprocess.Popen[bytes]) -> str:
        code = proc.returncode
        if code is not None and code < 0:
            return f"worker rank {rank} (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
        return f"worker rank {rank} (pid {proc.pid}) exited with code {code} (its traceback is above)"

    def stop(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
