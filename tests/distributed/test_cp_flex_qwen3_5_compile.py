"""``compile.enable`` with Qwen3.5 under context parallel through the real trainer: per-block
compile (DeltaNet blocks with graph breaks, the attention block's all-gather core) on CP 2,
document balancer, block_causal, 10 steps against one eager process (1e-5 relative loss;
docs/context_parallel.md, "Linear attention (Gated DeltaNet) under context parallel")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity_cases import LOSS_RTOL, assert_grad_norms_match
from tests.distributed.test_compile_float8 import COMPILE
from tests.distributed.test_qwen3_5_parity import BLOCK, CP, DOC_LB, LB, MODEL, PARITY, STEPS
from tests.launcher import run_ranks
from tests.parity import TINY, _train, assert_losses_match, losses


@pytest.mark.slow  # cold compiles of the DeltaNet and attention blocks: many minutes on CPU
def test_compiled_cp2_equals_one_eager_process(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    flavor = ("--model.flavor", "debugmodel", *BLOCK)
    ref = PARITY.reference(tmp_path_factory, flavor)
    argv = [*TINY, "--training.steps", str(STEPS), *MODEL, *flavor]
    argv += [CP, "2", *DOC_LB, LB, "8", *COMPILE]
    got = run_ranks(_train, 2, argv, str(tmp_path), timeout=1800)[0]
    label = "Qwen3.5 block_causal CP 2 document + compile"
    worst = assert_losses_match(losses(ref), losses(got), rtol=LOSS_RTOL, label=label)
    grad = assert_grad_norms_match(ref, got, label)
    print(f"{label}: worst relative loss difference {worst:.1e}, grad norm {grad:.1e}")
