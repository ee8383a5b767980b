"""AdamW/Adam with bf16 moments and/or bf16 parameters (master weights), stochastically rounded
(docs/memory.md).

Why not torchao: torchao 0.17/0.18's ``torchao.optim._AdamW`` keeps the moments in the
parameter's dtype (no bf16 moments beside fp32 weights; its 8-bit/4-bit/fp8 variants quantize
blockwise, a different trade), runs its update through ``torch.compile`` per parameter shape
(inductor, minutes on CPU) and needs the learning rate as a tensor, which our LambdaLR schedule
replaces by a float at every step.

The update is computed in fp32 from fp32 copies of the stored moments, exactly as
``torch.optim.AdamW`` (single-tensor path) computes it; only the stores round:

* moments in bf16 are stored with stochastic rounding (an exponential moving average with
  ``beta2 = 0.95..0.999`` moves by less than half a bf16 ulp per step, which round-to-nearest
  would lose every time; rounding up with probability equal to the dropped fraction keeps it
  unbiased);
* bf16 parameters are updated in fp32 and stored with stochastic rounding (the same reason: an
  update of ``lr ~ 1e-4`` relative is below bf16's resolution).

The random bits come from a generator seeded by (``seed``, step, parameter index), not from the
global RNG: a resumed run draws the same bits as an uninterrupted one (bitwise resume). With
``moments_dtype = float32`` and fp32 parameters nothing is rounded and the result equals
``torch.optim.AdamW(foreach=False)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

_MASK = -65536  # 0xFFFF0000 as a signed int32: the bits an fp32 keeps when it becomes bf16


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16, away from zero with probability equal to the fraction of
    a bf16 ulp that is dropped (so the expected value is ``x``)."""
    noise = torch.randint(
        0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator
    )
    bits = (x.contiguous().view(torch.int32) + noise) & _MASK
    return bits.view(torch.float32).to(torch.bfloat16)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (``decoupled=True``) or Adam with L2 decay, moments stored in ``moments_dtype``."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        moments_dtype: torch.dtype,
        decoupled: bool = True,
        seed: int = 0,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.moments_dtype = moments_dtype
        self.decoupled = decoupled
        self.seed = seed

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype)
        return state

    def _generator(self, device: torch.device, step: int, index: int) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed((self.seed * 1_000_003 + step) * 100_003 + index)
        return g

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                self._update(p, state, group, int(state["step"].item()), index)
        return loss

    def _update(
        self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: int, index: int
    ) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        param, grad = _local(p), _local(p.grad).float()  # type: ignore[arg-type]
        m_store, v_store = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        gen = None
        if self.moments_dtype == torch.bfloat16 or param.dtype == torch.bfloat16:
            gen = self._generator(param.device, step, index)
        w = param if param.dtype == torch.float32 else param.float()
        if self.decoupled:
            w.mul_(1 - lr * wd)
        elif wd != 0:
            grad = grad.add(w, alpha=wd)
        m = m_store if m_store.dtype == torch.float32 else m_store.float()
        v = v_store if v_store.dtype == torch.float32 else v_store.float()
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        w.addcdiv_(m, denom, value=-step_size)
        for store, full in ((m_store, m), (v_store, v), (param, w)):
            if store is not full:
                assert gen is not None
                store.copy_(stochastic_round_to_bf16(full, gen))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts every state tensor to its parameter's dtype (bf16 moments to
        fp32 beside fp32 weights, fp32 moments to bf16 beside bf16 weights, losing bits): put
        the saved moments back as they were, in ``moments_dtype``."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved_group["params"], group["params"]):
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in saved.get(pid, {}):
                        self.state[p][key] = saved[pid][key].to(self.moments_dtype)
