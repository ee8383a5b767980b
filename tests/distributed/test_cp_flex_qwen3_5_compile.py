"""``compile.enable`` with Qwen3.5 under context parallel through the real trainer: per-block
compile (DeltaNet blocks with graph breaks, the attention block's all-gather core) on CP 2,
document balancer, block_causal, 10 steps against one eager process (1e-5 relative loss;
docs/context_parallel.md, "Linear attention (Gated DeltaNet) under context parallel")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_compile_float8 import COMPILE
from tests.distributed.test_qwen3_5_parity import BLOCK, CP, DOC_LB, LB, _compare


@pytest.mark.slow  # a cold compile of the DeltaNet block's forward and backward: minutes on CPU
def test_compiled_cp2_equals_one_eager_process(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    overrides = [CP, "2", *DOC_LB, LB, "8", *COMPILE]
    label = "Qwen3.5 block_causal CP 2 document + compile"
    _compare("debugmodel", tmp_path_factory, tmp_path, 2, overrides, label, BLOCK)
