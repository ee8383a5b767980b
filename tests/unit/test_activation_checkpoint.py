"""Tier 1: activation checkpointing gives the gradients of no AC, and does save memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.distributed.activation_checkpoint import apply_ac, parse_selective_option
from torchtitan.loss.cross_entropy import cross_entropy_loss
from torchtitan.models.llama3 import LLAMA3_FLAVORS, Transformer

ARGS = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=4, max_seq_len=32)
WRAPPER = "_checkpoint_wrapped_module."


def _build(mode: str = "none", option: str = "op") -> Transformer:
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    apply_ac(model.layers, mode, option)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _grads_and_saved_bytes(model: Transformer) -> tuple[float, dict[str, torch.Tensor], int]:
    """Loss, gradients by plain parameter name, and the bytes autograd kept for backward."""
    inputs, labels = _batch()
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_loss(model(inputs), labels)
    loss.backward()
    grads = {
        n.replace(WRAPPER, ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return loss.item(), grads, saved


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict[str, torch.Tensor], int]:
    return _grads_and_saved_bytes(_build())


@pytest.mark.parametrize(
    "mode, option, wrapped",
    [
        ("full", "op", ["0", "1", "2", "3"]),
        ("selective", "1", ["0", "1", "2", "3"]),
        ("selective", "2", ["1", "3"]),
        ("selective", "3", ["2"]),
        ("selective", "op", ["0", "1", "2", "3"]),
    ],
)
def test_ac_gradients_identical_and_memory_lower(
    reference: tuple[float, dict[str, torch.Tensor], int],
    mode: str,
    option: str,
    wrapped: list[str],
) -> None:
    ref_loss, ref_grads, ref_saved = reference
    model = _build(mode, option)
    got = [k for k, b in model.layers.items() if isinstance(b, CheckpointWrapper)]
    assert got == wrapped
    loss, grads, saved = _grads_and_saved_bytes(model)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    worst = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    print(f"AC {mode}/{option}: max |grad diff| {worst:.3e}; saved {saved} vs {ref_saved} bytes")
    for k in ref_grads:  # recomputation replays the same kernels: bitwise equal
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=0, atol=0, msg=k)
    # Checkpointed blocks keep fewer activations for backward.
    assert saved < ref_saved * (1 - 0.5 * len(wrapped) / ARGS.n_layers), (saved, ref_saved)


def _backward_matmuls(model: Transformer) -> int:
    """Matmuls run during backward: two per linear, plus the recomputed forward ones."""
    inputs, labels = _batch()
    loss = cross_entropy_loss(model(inputs), labels)
    mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in mm:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        loss.backward()
    return Count.n


def test_op_level_recomputes_less_than_full() -> None:
    """op-level AC keeps every second matmul output: it recomputes half of full AC's matmuls."""
    none = _backward_matmuls(_build())
    full = _backward_matmuls(_build("full"))
    op = _backward_matmuls(_build("selective", "op"))
    print(f"backward matmuls: none {none}, op {op}, full {full}")
    # Full AC recomputes the block's forward up to the last value backward needs (torch's
    # early stop): 6 of the 7 matmuls (w2's output is not needed). op-level AC saves matmuls
    # 1, 3, 5, 7 (wq, wv, w1, w2) and recomputes wk, wo and w3.
    assert none < op < full
    assert full - none == 6 * ARGS.n_layers
    assert op - none == 3 * ARGS.n_layers


def test_ac_names_and_state_dict_unchanged() -> None:
    model = _build("full")
    plain = _build()
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert set(model.weight_init_plan()) == set(plain.weight_init_plan())


@pytest.mark.parametrize("text, value", [("op", "op"), (" OP ", "op"), ("1", 1), ("4", 4)])
def test_parse_selective_option(text: str, value: int | str) -> None:
    assert parse_selective_option(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "two", "", "1.5"])
def test_parse_selective_option_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_selective_option(text)


def test_apply_ac_twice_is_an_error() -> None:
    model = _build("full")
    with pytest.raises(RuntimeError, match="already"):
        apply_ac(model.layers, "full")
