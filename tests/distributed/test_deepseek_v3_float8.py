"""DeepSeek-V3 with float8 dense linears (docs/deepseek_v3.md, docs/float8.md): which linears
the converter swaps (MLA's projections, the dense SwiGLU, the MTP module's projection and its
block's attention; not the output head, and nothing inside the MoE layers: router, routed and
shared experts stay high precision), and the debug flavor trains with them (emulated on CPU)
close to fp32 with a falling loss and MTP loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.test_compile_float8 import FLOAT8, FLOAT8_RTOL
from tests.distributed.test_deepseek_v3_parity import PARITY
from tests.parity import assert_losses_match, losses, train_metrics
from torchtitan.distributed.float8 import apply_float8
from torchtitan.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, Transformer

MLA = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")


def test_float8_converts_mla_and_dense_linears_only() -> None:
    a = DEEPSEEK_V3_FLAVORS["debugmodel"]
    with torch.device("meta"):
        model = Transformer(a)
    converted = apply_float8(model, auto_filter_small_kn=False, device_type="cpu")
    expected = [f"layers.{i}.attention.{w}" for i in range(a.n_layers) for w in MLA]
    expected += [f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")]  # the dense block
    expected += ["mtp.0.eh_proj", *(f"mtp.0.block.attention.{w}" for w in MLA)]
    assert sorted(converted) == sorted(expected)
    assert not any(".moe." in n or n == "output" for n in converted)


@pytest.mark.slow
def test_float8_trains_close_to_fp32(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """10 steps on one process, local batch 8, against the fp32 reference of the parity tests."""
    ref = PARITY.reference(tmp_path_factory)
    got = train_metrics(
        [*PARITY.model, *FLOAT8, "--training.local_batch_size", "8"], 1, tmp_path, 10
    )
    worst = assert_losses_match(losses(ref), losses(got), rtol=FLOAT8_RTOL, label="float8 vs fp32")
    assert worst > 1e-6, "float8 losses equal fp32 exactly: were the linears converted?"
    loss, mtp = losses(got), [m["mtp/loss"] for m in got]
    print(f"float8: loss {loss[0]:.3f} -> {loss[-1]:.3f}, MTP loss {mtp[0]:.3f} -> {mtp[-1]:.3f}")
    assert loss[-1] < loss[0] - 0.3 and mtp[-1] < mtp[0] - 0.3
