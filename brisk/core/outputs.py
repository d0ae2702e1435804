"""What the scheduler hands the runner each step: plain ints and lists, no tensors.

One scheduled request, as the runner sees it:

    all_token_ids  [ computed earlier (KV in blocks) | token_ids (this step) | not known yet ]
                   0                       start_pos ┘                       └ start_pos + len(token_ids)
    block_ids      [[ b7 ][ b3 ][ b9 ][ b12 ]]  one table per KV group (core/kv_groups.py); the token
                                                 at position p lives in table[p // block_size], slot
                                                 p % block_size, of each group's table (a sliding
                                                 group's entries before its window are NO_BLOCK)

`sample` is True when `start_pos + len(token_ids)` reaches the end of the known tokens: the runner
must then produce the next token from the logits of the last one. A middle chunk of a long
prompt (chunked prefill) has `sample` False.

A decode step with speculation reserves `num_spec_slots` more slots after its one known token:

    all_token_ids  [ computed | t_last | d1 d2 .. dk (drafts, not in the request's tokens) ]
    block_ids      cover start_pos + 1 + k slots; num_computed_tokens advances by 1 at schedule time
                   and by the number of accepted drafts once they are verified.

Contract with the runner: every SchedulerOutput is executed before the next `schedule()`, and
within a step the KV of all scheduled tokens of a layer is written before attention reads the
cache (a request later in `scheduled` may hit blocks that an earlier one fills in this step).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step: all_token_ids[start_pos : start_pos + n]
    start_pos: int  # num_computed_tokens before this step (prefix-cache hits included)
    block_ids: list[list[int]]  # the request's block tables, one per KV group, covering start_pos + len(token_ids)
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    # Speculative decoding: KV slots reserved after token_ids for up to this many draft tokens.
    # The proposer fills them in this step; the verifier keeps the accepted ones (see speculative/).
    num_spec_slots: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0  # sum of len(token_ids) over `scheduled`, <= max_num_batched_tokens
    preempted_ids: list[str] = field(default_factory=list)  # lost their KV this step; will recompute
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since the last step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
