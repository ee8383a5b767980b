"""Any transformers causal LM as one of our models (docs/hf_models.md).

``build_hf_model`` instantiates ``AutoModelForCausalLM.from_config`` with every parameter on
``meta`` (the trainer materializes them after parallelizing) and every buffer computed for
real on the CPU (RoPE frequencies, embedding scales: they come from the config, and
``to_empty`` would leave them garbage), then turns the instance into a :class:`HFTrainable`:

* parameter names stay the transformers ones (``model.layers.0.self_attn.q_proj.weight``), so
  a Hugging Face folder loads and saves without renaming (``adapter.py``);
* the decoder layers (``model.layers``, an ``nn.ModuleList``) become a :class:`LayerDict`, the
  ``nn.ModuleDict`` our generic layers shard, checkpoint and compile one block at a time, which
  still answers transformers' ``self.layers[: n]``;
* ``forward(tokens)`` returns the logits (no KV cache), ``init_weights(seed)`` fills every
  parameter from a generator seeded by its name (``distributed/init_weights.py``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from torchtitan.distributed.init_weights import ParamInit, init_params_deterministic

_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class LayerDict(nn.ModuleDict):
    """The decoder layers keyed ``"0" .. "n-1"`` (an FSDP/AC/compile unit each), indexable
    like the ``nn.ModuleList`` transformers' forward slices (``layers[: n]``, ``layers[i]``)."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return list(self.values())[key]
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to ``meta`` (its storage freed at once); buffers
    keep the device they were computed on."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


class HFTrainable(nn.Module):
    """Mixed into the transformers class of a built model (``build_hf_model``): what our
    trainer calls on a model (docs/architecture.md, section 6)."""

    _titan_buffers: list[tuple[nn.Module, str, torch.Tensor]]
    _titan_init_range: float

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: Any = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of ``tokens`` ``[B, S]``. ``cache`` (generation, ``models/common/kv_cache.py``):
        ``tokens`` continue the cached sequence at ``positions``; the keys and values live in a
        transformers ``DynamicCache`` the cache object carries, its length in the cache's one
        entry. Document masks are not supported (validation refuses ``block_causal``)."""
        if doc_ids is not None:
            raise ValueError("the hf family has no block-causal document mask")
        if cache is None:
            if positions is not None:
                raise ValueError("the hf family takes positions only with a KV cache")
            out = super().forward(input_ids=tokens, use_cache=False)  # type: ignore[misc]
            return out.logits
        from transformers import DynamicCache

        hf_cache = getattr(cache, "hf_cache", None)
        if hf_cache is None:
            hf_cache = cache.hf_cache = DynamicCache(config=self.config)  # type: ignore[arg-type]
        pos = None if positions is None else positions.reshape(1, -1).expand(tokens.shape[0], -1)
        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns)
        params = inspect.signature(super().forward).parameters  # type: ignore[misc]
        name = "cache" if "cache" in params else "past_key_values"
        out = super().forward(  # type: ignore[misc]
            input_ids=tokens, use_cache=True, position_ids=pos, **{name: hf_cache}
        )
        cache.layer("hf").length += tokens.shape[1]
        return out.logits

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # nn.Module._apply converts each module's parameters on their own, so to_empty (from
        # meta) would untie a shared embedding/output matrix: tie them again.
        super()._apply(fn, recurse)
        emb, head = _embedding(self), _head(self)
        if _tied(self) and emb is not None and head is not None and head.weight is not emb.weight:
            head.weight = emb.weight
        return self

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Put back the buffers computed at build (``to_empty`` leaves them uninitialized)."""
        for module, name, value in self._titan_buffers:
            target = device if device is not None else module._buffers[name].device  # type: ignore[union-attr]
            module._buffers[name] = value.to(target)

    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        """``init_buffers``, then every parameter from ``weight_init_plan`` (seeded by name)."""
        self.init_buffers(buffer_device)
        init_params_deterministic(self, self.weight_init_plan(), seed)

    def weight_init_plan(self) -> dict[str, ParamInit]:
        """Matrices and embeddings: truncated normal with the config's ``initializer_range``;
        norm scales and biases: the constant transformers' own init gives them (ones for most
        norms, zeros for Gemma's ``1 + w`` norms and for biases), read from a CPU copy."""
        std = self._titan_init_range
        plan: dict[str, ParamInit] = {}
        owners = dict(self.named_modules())
        probed: dict[tuple[type, str], ParamInit] = {}  # one probe per module class and leaf
        for name, param in self.named_parameters():
            fqn = _clean(name)
            if param.dim() >= 2:
                plan[fqn] = ParamInit("trunc_normal", std=std)
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = owners[owner_name]
            key = (type(owner), leaf)
            if key not in probed:
                probed[key] = _constant_init(self, owner, leaf)
            plan[fqn] = probed[key]
        return plan


def _clean(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _constant_init(model: nn.Module, module: nn.Module, leaf: str) -> ParamInit:
    """The constant transformers' ``_init_weights`` puts in ``module.<leaf>`` (a vector)."""
    probe = copy.deepcopy(module).to_empty(device="cpu")
    with torch.no_grad():
        for p in probe.parameters(recurse=False):
            p.fill_(float("nan"))
        # a class whose init needs more than the module leaves NaN: zeros below
        with contextlib.suppress(Exception):
            model._init_weights(probe)  # type: ignore[operator]
    value = getattr(probe, leaf)
    if bool((value == 1).all()):
        return ParamInit("ones")
    return ParamInit("zeros")  # biases, zero-centred norm scales, or no rule: zeros


def _embedding(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_input_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None


def _head(model: nn.Module) -> nn.Module | None:
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Module) else None


def _tied(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    return bool(getattr(text, "tie_word_embeddings", False))


def decoder_layers_path(model: nn.Module) -> str:
    """The module path of the repeated decoder layers: the ``nn.ModuleList`` (a
    :class:`LayerDict` once built) whose items are the class transformers names in
    ``_no_split_modules`` (``model.layers`` in most)."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    for path, module in model.named_modules():
        layers = isinstance(module, (nn.ModuleList, LayerDict)) and len(module) > 0
        if layers and type(module[0]).__name__ in no_split:  # type: ignore[index]
            return path
    raise ValueError(
        f"{type(model).__name__}: no nn.ModuleList of its _no_split_modules {sorted(no_split)}"
    )


def build_hf_model(
    config: Any, attn_implementation: str = "sdpa", trust_remote_code: bool = False
) -> nn.Module:
    """The transformers model of ``config`` (a ``PretrainedConfig``) as an :class:`HFTrainable`,
    its parameters on ``meta`` and its buffers computed on the CPU; ``trust_remote_code``
    builds the class the config's ``auto_map`` names (``model.hf_trust_remote_code``)."""
    from transformers import AutoModelForCausalLM

    with torch.device("cpu"), _params_on_meta():
        model = AutoModelForCausalLM.from_config(
            config,
            attn_implementation=attn_implementation,
            dtype=torch.float32,
            trust_remote_code=trust_remote_code,
        )
    path = decoder_layers_path(model)
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    layers = getattr(parent, leaf)
    setattr(parent, leaf, LayerDict({str(i): layer for i, layer in enumerate(layers)}))
    cls = type(model)
    model.__class__ = type(f"Titan{cls.__name__}", (HFTrainable, cls), {})
    model._titan_buffers = [
        (m, n, b.detach().clone())
        for m in model.modules()
        for n, b in m._buffers.items()
        if b is not None
    ]
    text = config.get_text_config()
    model._titan_init_range = float(getattr(text, "initializer_range", 0.02) or 0.02)
    return model


@functools.lru_cache(maxsize=8)
def meta_model(args: Any) -> nn.Module:
    """The model of ``args`` (``HFArgs``) on ``meta``: the plan, the parameter count and the
    estimator read it (building under ``meta`` allocates nothing)."""
    with torch.device("meta"):
        return build_hf_model(args.config, trust_remote_code=args.trust_remote_code)
