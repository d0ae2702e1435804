"""One builder per speculative method: `speculative_config={"method": name}` -> a Proposer.

A proposer module registers its builder with `@register(name)`; the engine hands every builder
one `ProposerContext` (the target, its runner, the loaded draft model, and a factory for a draft's
own runner and KV), so proposers never import the runtime or the KV managers. Adding a method:
its class and builder in one file here, its name in config.SPEC_METHODS (validation), an import
below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from brisk.config import SpecConfig
from brisk.errors import UserError
from brisk.model.base import CausalLM
from brisk.speculative.base import Proposer


class ProposerContext(Protocol):
    """What the engine offers a builder."""

    config: SpecConfig
    target: CausalLM
    runner: Any  # the target's runtime.paged_runner.PagedModelRunner (early exit writes its KV)
    draft_model: CausalLM | None  # method draft: the loaded draft model

    def draft_runtime(self, model: CausalLM) -> tuple[Any, Any]:
        """A runner and a KV manager of the draft's own, as many KV slots as the target has."""
        ...


@dataclass(frozen=True)
class Method:
    build: Callable[[ProposerContext], Proposer]
    parallel: bool  # drafts over tensor/pipeline-parallel workers (needs nothing on other ranks)


METHODS: dict[str, Method] = {}


def register(name: str, parallel: bool = False) -> Callable[[Callable[[ProposerContext], Proposer]],
                                                          Callable[[ProposerContext], Proposer]]:
    def add(build: Callable[[ProposerContext], Proposer]) -> Callable[[ProposerContext], Proposer]:
        METHODS[name] = Method(build, parallel)
        return build
    return add


def method(name: str) -> Method:
    if name not in METHODS:
        raise UserError(f"speculative method {name!r} is not available; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


# the proposers register themselves on import
from brisk.speculative import draft, early_exit, medusa, ngram, streaming  # noqa: E402, F401
