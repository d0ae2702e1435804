"""The llama.cpp peer's failures say what to do: a segfault on a CPU with AMX names its backend's
known crash and the build without it."""

from __future__ import annotations

import pytest

from brisk.bench import latency
from brisk.kernels import CAPS


def test_a_segfault_on_an_amx_cpu_names_the_build_without_amx() -> None:
    hint = latency._crash_hint(-11)
    if CAPS.cpu_amx:
        assert "ggml-org/llama.cpp#20824" in hint and "-DGGML_AMX_INT8=OFF" in hint
        assert "pip install --no-cache-dir llama-cpp-python==0.3.36" in hint
    else:
        assert hint == ""
    assert latency._crash_hint(1) == "" and latency._crash_hint(0) == ""


def test_a_peer_that_dies_at_start_is_a_clear_error(tmp_path) -> None:
    fake = tmp_path / "peer.sh"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"the llama.cpp peer exited \(code 3\); see its stderr above$"):
        latency.LlamaCppPeer(str(fake), "model.gguf", 1, 64)
