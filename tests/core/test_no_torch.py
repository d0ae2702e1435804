"""core/ speaks ints and lists (ARCHITECTURE.md, habit 2): importing it must not load torch."""

import subprocess
import sys


def test_core_imports_without_torch() -> None:
    code = ("import sys, brisk.core.scheduler, brisk.core.kv_cache_manager, brisk.core.block_pool; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
