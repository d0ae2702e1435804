"""Start, feed and watch the processes of a tensor x pipeline parallel engine.

One node: `LLM(..., tensor_parallel_size=T, pipeline_parallel_size=P)` spawns ranks 1..T*P-1 as
`python -m brisk.engine.workers '<json>'` and becomes rank 0 itself. Many nodes: torchrun starts
every rank with the same brisk command (RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment);
rank 0 runs the engine and the server, the others `run_worker` (see cli.py and README).

Every rank builds its own model the same way (`build_rank`): load the float weights, keep its
tensor shard, quantize the shard if asked, drop the other stages' layers. Rank 0 sizes the KV cache
and broadcasts the block count, so every rank's blocks line up with the one scheduler's ids.

Rooms, one job each: args.py (what a rank is told), checks.py (errors before any process starts),
rank.py (a rank's model and a worker's life), processes.py (rank 0 watching its children),
cluster.py (rank 0's bootstrap), __main__.py (the worker process).
"""

from __future__ import annotations

from brisk.engine.workers.args import WorkerArgs, torchrun_rank
from brisk.engine.workers.checks import check_parallel
from brisk.engine.workers.cluster import Cluster, start_cluster
from brisk.engine.workers.processes import LOST_GROUP, WorkerSet
from brisk.engine.workers.rank import build_rank, run_worker

__all__ = ["LOST_GROUP", "Cluster", "WorkerArgs", "WorkerSet", "build_rank", "check_parallel", "run_worker", "start_cluster",
           "torchrun_rank"]
