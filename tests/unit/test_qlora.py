"""QLoRA (docs/lora.md): the NF4 base computes within NF4's rounding of the bf16 weights, trains
its adapters with a falling loss, and its tracked tensor memory (``planner/tracker.py``) is below
LoRA's, which is below full fine-tuning's (weights, gradients and optimizer state; the tracked
peak of a step is printed too)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_args import tiny_llama3
from torchtitan.config.job_config import Lora
from torchtitan.lora.apply import apply_lora, init_adapters
from torchtitan.lora.qlora import nf4_shard_problem, quantize_base
from torchtitan.models import MODELS
from torchtitan.planner.tracker import LiveTensorTracker
from torchtitan.tools.torch_compat import torch_version_tuple

pytest.importorskip("torchao")

ARGS = tiny_llama3(dim=512, heads=(4, 2), vocab=256, n_layers=2)
TARGETS = ["attention.w*", "feed_forward.w*"]


def _build(mode: str) -> torch.nn.Module:
    model = MODELS["llama3"].build(ARGS)
    model.init_weights(seed=0)
    if mode != "full":
        apply_lora(model, Lora(enable=True, rank=8, target_modules=TARGETS))
        init_adapters(model, seed=0)
    if mode == "qlora":
        quantize_base([model])
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)  # one fixed batch: the loss must fall on it
    tokens = torch.randint(0, ARGS.vocab_size, (1, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: torch.nn.Module, steps: int) -> tuple[list[float], torch.optim.Optimizer]:
    params = [p for p in model.parameters() if p.requires_grad]
    full = all(p.requires_grad for p in model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3 if full else 1e-2)
    out = []
    for step in range(steps):
        x, y = _batch(step)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out, opt


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the weights (NF4 codes and scales included), gradients and optimizer state."""
    tensors = [t for p in model.parameters() for t in _storages(p)]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _storages(p: torch.Tensor) -> list[torch.Tensor]:
    inner = getattr(p, "__tensor_flatten__", None)
    if type(p).__name__ == "NF4Tensor" and inner is not None:
        return [getattr(p, name) for name in inner()[0]]
    return [p]


@pytest.mark.slow
def test_qlora_memory_table_and_falling_loss() -> None:
    rows = {}
    for mode in ("full", "lora", "qlora"):
        with LiveTensorTracker() as tracker:
            model = _build(mode)
            tracker.reset_peak()
            losses, opt = _train(model, 6)
            rows[mode] = (_state_bytes(model, opt), tracker.peak, losses)
            del model, opt
    print("\nmode  | weights+grads+optimizer MiB | tracked peak MiB | loss first -> last")
    for mode, (state, peak, losses) in rows.items():
        mib = f"{state / 2**20:27.2f} | {peak / 2**20:16.2f}"
        print(f"{mode:5} | {mib} | {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert rows["qlora"][0] < rows["lora"][0] < rows["full"][0]
    # The peak adds each matmul's dequantized weight (fp32 here) to QLoRA's: about LoRA's peak
    # at this size; both far below full fine-tuning's.
    assert max(rows["qlora"][1], rows["lora"][1]) < rows["full"][1] / 2
    for mode, (_, _, losses) in rows.items():
        assert losses[-1] < losses[0] - 0.5, (mode, losses)


@pytest.mark.smoke
def test_nf4_forward_is_close_to_the_bf16_base() -> None:
    torch.manual_seed(0)
    lora, qlora = _build("lora"), _build("qlora")
    x, _ = _batch(0)
    with torch.no_grad():
        ref, got = lora(x), qlora(x)
    rel = ((got - ref).norm() / ref.norm()).item()
    print(f"NF4 base vs fp32 base: relative logit error {rel:.3f}")
    assert 0 < rel < 0.2, rel


def test_nf4_shard_rule() -> None:
    """FSDP keeps whole NF4 scale groups per rank (lora/qlora.py): a 4096 x 4096 weight (1,024
    groups of 256 blocks) splits over 2 or 8 ranks; a 64 x 64 one (one group of 64 blocks) not."""
    assert nf4_shard_problem((4096, 4096), 8) is None and nf4_shard_problem((64, 64), 1) is None
    problem = nf4_shard_problem((64, 64), 2)
    assert (
        problem is not None and "1 NF4 scale groups" in problem and "2 equal row blocks" in problem
    )
    assert nf4_shard_problem((3, 4), 1) is not None  # 12 values: not whole blocks of 64


@pytest.mark.smoke
def test_nf4_comes_from_the_installed_torchao_and_trains() -> None:
    """The NF4 module is the one the installed torchao has (0.17 keeps it in ``torchao.dtypes``,
    0.18 under ``torchao.quantization``: an import of the other path broke QLoRA on the GPU
    image's torch 2.11 + torchao 0.17); a QLoRA model built through it trains its adapters."""
    import importlib.metadata

    from torchtitan.tools.torch_compat import _NF4_MODULE_BY_TORCHAO, torchao_nf4

    have = torch_version_tuple(importlib.metadata.version("torchao"))
    nf4 = torchao_nf4()
    if have in _NF4_MODULE_BY_TORCHAO:
        assert nf4.__name__ == _NF4_MODULE_BY_TORCHAO[have]
    model = _build("qlora")
    assert type(model.layers["0"].attention.wq.weight).__name__ == "NF4Tensor"
    losses, _ = _train(model, 3)
    assert losses[-1] < losses[0] - 0.1, losses
