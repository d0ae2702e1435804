"""A worker process: `python -m brisk.engine.workers '<json>'` (rank 0 starts these, processes.py)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

from brisk.engine.workers.args import WorkerArgs
from brisk.engine.workers.processes import LOST_GROUP
from brisk.engine.workers.rank import run_worker
from brisk.parallel.groups import local_store


def _exit_with_parent() -> None:
    """A worker whose rank 0 vanished (killed, crashed) must not linger: watch the parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    spec = json.loads(sys.argv[1])
    _exit_with_parent()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        args = WorkerArgs(**spec["args"])
        run_worker(args, spec["rank"], local_store(spec["rank"], args.parallel.world_size, spec["port"]))
    except (RuntimeError, OSError) as e:
        # Told apart by text: gloo (torch 2.13) raises a plain RuntimeError, not one of
        # torch.distributed's DistError types, when a peer is gone ("Connection closed by peer"
        # from all_reduce, recv and broadcast_object_list alike; checked 2026-12-05)
        if "Connection" not in str(e) and "Timed out" not in str(e) and "timeout" not in str(e).lower():
            raise  # a real error of this worker: its traceback tells rank 0's user what happened
        # another rank went away (rank 0 reports which): one line, not a traceback per survivor
        print(f"brisk worker rank {spec['rank']}: lost the group, exiting ({str(e).splitlines()[0][:200]})",
              file=sys.stderr)
        sys.exit(LOST_GROUP)


if __name__ == "__main__":
    main()
