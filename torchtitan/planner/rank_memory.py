"""One rank's memory over one optimizer step (docs/planning.md): the state it holds all step and
the moments that can be its peak, from the formulas of ``memory_terms.py``. ``estimator.py``
runs it for each pipeline rank and keeps the largest."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import parse_selective_option
from torchtitan.distributed.data_parallel import reshard_policy
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_stages import PipelineStages
from torchtitan.distributed.utils import resolve_dtype
from torchtitan.fault_tolerance.memory import fault_tolerance_memory
from torchtitan.models import MODELS
from torchtitan.models.spec import DecoderShape as ModelArgs
from torchtitan.planner import moe_memory as moe_terms
from torchtitan.planner.lora_memory import NF4_BYTES, lora_counts
from torchtitan.planner.memory_terms import (
    MUON_BUFFER_BYTES,
    MemoryEstimate,
    TowerMemory,
    block_backward_bytes,
    block_ids,
    checkpoint_mode,
    format_bytes,
    in_flight_microbatches,
    is_mla,
    layer_activations,
    layer_shapes,
    loss_working_set,
    master_weight_bytes,
    mla_note,
    mtp_root_shapes,
    mtp_saved_bytes,
    muon_step_bytes,
    norm_upcast_bytes,
    optimizer_state_bytes_per_param,
    param_dtype_bytes,
    shard_elems,
    stage_shapes,
    total_elems,
    tower_memory,
)


class _Moment(NamedTuple):
    """One candidate for the peak: its total and the parts the estimate reports."""

    total: int
    phase: str
    activations: int
    working_set: int
    gradients: int
    unsharded: int


class RankMemory:
    """One pipeline rank's optimizer step (docs/planning.md): what it holds all step (built in
    order by ``_hold``, ``_gather``, ``_activations`` and ``_gradients``), then the moments that
    may be its peak (the loss backward, each block's backward, the embedding's backward, the
    optimizer step). ``estimate()`` reports the largest."""

    def __init__(
        self,
        cfg: JobConfig,
        a: ModelArgs,
        dims: ParallelDims,
        plan: PipelineStages | None,
        pp_rank: int,
        device_type: str,
        steady_state: bool,
    ) -> None:
        self.cfg, self.a, self.dims, self.plan, self.pp_rank = cfg, a, dims, plan, pp_rank
        self.device_type = device_type
        self.tp, self.cp, self.n_shard = dims.tp, dims.cp, dims.dp_shard * dims.cp
        self.fsdp = dims.fsdp_enabled
        self.act = param_dtype_bytes(cfg, device_type)
        self.mw = master_weight_bytes(cfg)  # stored parameters and their gradients
        self.offload = cfg.parallelism.fsdp_cpu_offload and self.fsdp
        self.shapes = stage_shapes(a, self.tp)
        self.notes: list[str] = []
        generic = getattr(MODELS[cfg.model.name], "estimate_note", None)
        if generic:  # the family's shape is read generically (the hf family)
            self.notes.append(generic)
        self._hold(steady_state)
        self._gather()
        self._activations()
        self._gradients()

    # ------------------------------------------------------------------ all step
    def _stored(self, shape_list: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> int:
        return sum(shard_elems(s, self.n_shard) if self.fsdp else s[0] * s[1] for s in shape_list)

    def _hold(self, steady_state: bool) -> None:
        """This rank's stages' blocks, the embedding / head if it has them, and their state."""
        a, shapes, plan = self.a, self.shapes, self.plan
        model_plan = MODELS[self.cfg.model.name].parallel_plan(a)
        every_unit = model_plan.unit_names
        units = (
            [u for s in plan.stage_ids(self.pp_rank) for u in plan.stage_units[s]]
            if plan
            else every_unit
        )
        self.layers = block_ids(units, model_plan.blocks)
        self.has_embedding, self.has_head = every_unit[0] in units, every_unit[-1] in units
        roots: list[tuple[int, int]] = []
        if self.has_embedding:
            roots.append(shapes.embedding)
        if self.has_head:
            tied = a.tie_word_embeddings and self.has_embedding
            roots += [shapes.head[0]] if tied else list(shapes.head)
        # DeepSeek-V3's MTP modules travel with the head: their blocks count as blocks
        # ``n_layers + k`` (never checkpointed), their norms and projection as root weights.
        depth = getattr(a, "mtp_depth", 0) if self.has_head else 0
        self.mtp_layers = [a.n_layers + k for k in range(depth)]
        roots += mtp_root_shapes(a, depth)
        self.root_shapes = roots
        self.tower: TowerMemory | None = (
            None  # a vision tower: with the embedding, on the first stage
        )
        if self.has_embedding:
            samples = self.cfg.training.local_batch_size // (plan.n_microbatches if plan else 1)
            self.tower = tower_memory(a, self.cfg, samples, self.act, self.device_type)
        tower = self.tower.shapes if self.tower else []
        # Per block (MoE blocks: router, experts per expert parallel, shared experts).
        self.sizes = {
            i: moe_terms.block_sizes(
                a, *layer_shapes(a, i, self.tp, shapes), i, self._stored, self.dims.ep,
                self.n_shard, self.fsdp,
            )
            for i in self.layers + self.mtp_layers
        }  # fmt: skip
        param_elems = self._stored(roots + tower) + sum(b.stored for b in self.sizes.values())
        self.parameters = param_elems * self.mw
        moments = param_elems * optimizer_state_bytes_per_param(self.cfg.optimizer.moments_dtype)
        self.muon_step = 0
        if self.cfg.optimizer.name == "Muon":  # blocks: one buffer; roots and norms: AdamW
            moments = self._muon_state(roots + tower)  # the tower's: AdamW's
        self.optimizer_states = moments if steady_state else 0
        self.grads_all = param_elems * self.mw
        self.trained = 1.0  # the share of the parameter elements that get gradients
        if self.cfg.lora.enable:
            self._hold_lora(param_elems, steady_state)
        self.host, self.ft_sync = 0, 0
        ft = fault_tolerance_memory(
            self.cfg.fault_tolerance, self.parameters, self.grads_all, self.optimizer_states
        )
        if ft is not None:  # recovery buffer, DiLoCo's outer state (fault_tolerance/memory.py)
            self.optimizer_states += ft.held if steady_state else 0  # made at the first sync
            self.host, self.ft_sync = ft.host, ft.sync
            self.notes.append(ft.note)
        if self.offload:  # shards, their gradients and the optimizer live on the host
            self.host += self.parameters + self.grads_all + self.optimizer_states
            self.parameters, self.optimizer_states = 0, 0
            self.notes.append(f"CPU offload: {format_bytes(self.host)} in host memory")

    def _muon_state(self, roots: list[tuple[int, int]]) -> int:
        """Muon's state (docs/optimizers.md): AdamW's two moments for the embedding and head,
        one fp32 momentum buffer per block element (the norms' second moment is neglected),
        and the transient gather buffers of its step."""
        blocks = sum(b.stored for b in self.sizes.values())
        adam = self._stored(roots) * optimizer_state_bytes_per_param("float32")
        ns_bytes = resolve_dtype(self.cfg.optimizer.muon_ns_dtype, self.device_type).itemsize
        shapes = self.shapes
        self.muon_step = muon_step_bytes(
            shapes.block, shapes.block_linear, len(self.layers), self._stored, ns_bytes
        )
        self.notes.append(
            f"Muon: one momentum buffer per block matrix element, AdamW's two for the "
            f"embedding/head; its step gathers up to {format_bytes(self.muon_step)} of matrices"
        )
        return adam + blocks * MUON_BUFFER_BYTES

    def _hold_lora(self, param_elems: int, steady_state: bool) -> None:
        """LoRA: a frozen base (no gradients or moments), trained fp32 adapters; QLoRA stores
        the adapted weights in NF4 (planner/lora_memory.py)."""
        lo = self.cfg.lora
        c = lora_counts(self.cfg.model.name, self.a, lo)
        share = param_elems / max(c.total, 1)
        adapters, adapted = int(c.adapters * share), int(c.adapted * share)
        per_adapted = NF4_BYTES if lo.quantize_base == "nf4" else self.mw
        base = (param_elems - adapted) * self.mw + int(adapted * per_adapted)
        self.parameters = base + adapters * 4
        moments = adapters * optimizer_state_bytes_per_param(self.cfg.optimizer.moments_dtype)
        self.optimizer_states = moments if steady_state else 0
        self.grads_all = adapters * 4
        self.trained = adapters / max(param_elems, 1)
        kind = "QLoRA (NF4 base)" if lo.quantize_base == "nf4" else "LoRA"
        self.notes.append(
            f"{kind}: frozen base {format_bytes(base)}, {adapters:,} adapter parameters "
            "(gradients and optimizer state for those only)"
        )

    def _gather(self) -> None:
        """Parameters in their compute form while forward/backward runs."""
        dims, act, fsdp = self.dims, self.act, self.fsdp
        f8 = self.cfg.quantize.dense.float8
        big = max(self.sizes.values(), key=lambda b: b.gathered) if self.sizes else None
        block_full = big.gathered if big else 0  # the largest block (MoE blocks differ)
        linear_full = big.linear_gathered if big else 0
        self.unsharded_block = block_full * act
        if f8.enable and f8.enable_fsdp_float8_all_gather and fsdp:
            self.unsharded_block = linear_full * 1 + (block_full - linear_full) * act
            self.notes.append("float8 all-gather: block linears gathered in float8 (1 byte)")
        self.unsharded_root = total_elems(tuple(self.root_shapes)) * act
        tower = total_elems(tuple(self.tower.shapes)) * act if self.tower else 0
        self.reshard = reshard_policy(
            self.cfg.parallelism.fsdp_reshard_after_forward, dims.pp_enabled
        )
        self.needs_copy = fsdp or dims.ddp_enabled or act != self.mw
        n_layers = len(self.layers)
        if not self.needs_copy:
            self.unsharded_fwd = 0
        elif fsdp or dims.ddp_enabled:
            blocks_live = 2 if self.reshard else n_layers  # current + prefetched, or all
            self.unsharded_fwd = (
                self.unsharded_root + min(blocks_live, n_layers) * self.unsharded_block
            ) + (0 if self.reshard else tower)  # resharded: gathered only while it runs
        elif self.cfg.lora.enable:  # autocast caches no copy of a frozen weight
            self.unsharded_fwd = self.unsharded_root + min(2, n_layers) * self.unsharded_block
        else:  # autocast without FSDP: a low-precision copy of every weight until backward ends
            self.unsharded_fwd = self.unsharded_root + n_layers * self.unsharded_block + tower
            self.notes.append("autocast keeps a low-precision copy of every weight during the step")

    def _activations(self) -> None:
        """Saved activations per microbatch and of the microbatches in flight, and the pipeline
        receive buffers (one activation and one gradient buffer per microbatch)."""
        a, t, plan, act, tp = self.a, self.cfg.training, self.plan, self.act, self.tp
        self.n_mb = plan.n_microbatches if plan else 1
        self.mb_tokens = tokens = t.local_batch_size // self.n_mb * t.seq_len // self.cp
        self.in_flight = in_flight_microbatches(plan, self.pp_rank)
        ac = self.cfg.activation_checkpoint
        option: int | str = (
            parse_selective_option(ac.selective_ac_option) if ac.mode == "selective" else 0
        )
        self.modes = {i: checkpoint_mode(i, ac.mode, option) for i in self.layers}
        self.modes.update({i: "none" for i in self.mtp_layers})
        self.per_block, self.full_block = {}, {}
        for i in self.layers + self.mtp_layers:
            self.per_block[i] = self._layer(i, self.modes[i])
            self.full_block[i] = self._layer(i, "none")
        self.vocab_local = a.vocab_size // tp
        head_saved = 0
        if self.has_head:
            # final norm (x, normed: sequence-sharded; output: gathered under TP) + fp32
            # log-softmax
            head_saved = (
                int(tokens * (3 * a.dim / tp if tp == 1 else 2 * a.dim / tp + a.dim) * act)
                + norm_upcast_bytes(a, tokens, act, tp, self.device_type)
                + loss_working_set(tokens, self.vocab_local, act, t.loss_chunk_size)[0]
            )
        if self.mtp_layers:
            head_saved += mtp_saved_bytes(a, tokens, act, tp, len(self.mtp_layers))
            self.notes.extend(self._mtp_notes(t.seq_len))
        if is_mla(a):
            self.notes.append(mla_note(a, self.per_block, tokens))
        self.emb_saved = tokens * 8 if self.has_embedding else 0  # token ids
        if self.tower is not None:  # live until the tower's backward, like the token ids
            self.emb_saved += self.tower.saved_bytes
            self.notes.append(self._tower_note())
        self.stages = len(plan.stage_ids(self.pp_rank)) if plan else 1
        self.per_mb = sum(self.per_block.values()) + head_saved + self.emb_saved
        # In-flight microbatch-stages hold on average 1/stages of this rank's activations each.
        self.activations_all = self.per_mb * self.in_flight // self.stages if plan else self.per_mb
        self.pipeline_buffers = 0
        if plan is not None:
            # (with MTP the first stage's MTP input embeddings travel with the residual)
            residual = tokens * a.dim // tp * act * (1 + getattr(a, "mtp_depth", 0))
            first = 0 in plan.stage_ids(self.pp_rank)
            last = plan.num_stages - 1 in plan.stage_ids(self.pp_rank)
            n_recv = (self.stages - (1 if first else 0)) + (self.stages - (1 if last else 0))
            self.pipeline_buffers = self.n_mb * residual * n_recv

    def _mtp_notes(self, seq_len: int) -> list[str]:
        """What the MTP modules cost: parameters, saved activations, FLOPs per token."""
        a: Any = self.a
        depth = len(self.mtp_layers)
        params = depth * a.mtp_params()
        saved = sum(self.per_block[i] for i in self.mtp_layers) + mtp_saved_bytes(
            a, self.mb_tokens, self.act, self.tp, depth
        )
        flops = a.flops_per_token(seq_len)
        without = dataclasses.replace(a, mtp_depth=0).flops_per_token(seq_len)
        return [
            f"MTP: {depth} module(s) on the last stage: {params / 1e6:,.1f} M parameters, "
            f"{format_bytes(saved)} saved per microbatch (block, norms, fp32 log-softmax), "
            f"{(flops - without) / 1e6:,.1f} of {flops / 1e6:,.1f} MFLOPs per token"
        ]

    def _layer(self, i: int, mode: str) -> int:
        return layer_activations(
            self.a, i, self.mb_tokens, self.act, self.dims, mode, self.device_type
        )

    def _gradients(self) -> None:
        """Gradients of earlier microbatches stay through later ones: gradient accumulation,
        and the pipeline's steady state (a backward, then more in-flight forwards). Under PP,
        torch's stages run every backward without FSDP's gradient sync: the gradients
        accumulate unsharded (in the reduce dtype) and the parameters stay gathered until the
        step's end."""
        t, dims, plan, act = self.cfg.training, self.dims, self.plan, self.act
        accum = dims.batch_sizes(t.local_batch_size, t.global_batch_size).grad_accum_steps
        self.steady = plan is not None and self.n_mb * self.stages > self.in_flight
        self.reduce_bytes = (
            resolve_dtype(t.mixed_precision_reduce, self.device_type).itemsize if act != 4 else 4
        )
        self.pp_fsdp = plan is not None and self.fsdp
        tower = self.tower.shapes if self.tower else []
        unsharded_grads = (
            total_elems(tuple(self.root_shapes + tower))
            + sum(b.gathered for b in self.sizes.values())
        ) * self.reduce_bytes
        unsharded_grads = int(unsharded_grads * self.trained)
        self.device_grads = 0 if self.offload else self.grads_all  # offloaded: on the host
        self.carried_grads = self.device_grads if accum > 1 else 0
        if self.steady:
            self.carried_grads = unsharded_grads if self.pp_fsdp else self.device_grads
        self.out_grad = 0
        if self.has_head and (self.fsdp or act != self.mw):
            self.out_grad = total_elems(tuple(self.root_shapes)) * act
        elif self.has_head and not self.offload:  # the head's .grad, from the loss backward
            self.out_grad = total_elems(self.shapes.head) * self.mw
        if self.cfg.lora.enable:  # a frozen head has no weight gradient
            self.out_grad = total_elems(tuple(self.root_shapes)) * act if self.fsdp else 0
        # The head's gradient during the blocks' and the embedding's backward, unless it is
        # already in the carried gradients (PP x FSDP's steady state).
        self.root_grad = 0 if self.pp_fsdp and self.steady else self.out_grad

    # ------------------------------------------------------------------ the moments
    def _loss_backward(self) -> _Moment:
        """The head rank's loss backward: its logits-sized working set."""
        t = self.cfg.training
        head_grad = self.act if self.fsdp else self.mw  # the output weight's gradient, chunked
        loss_ws = 0
        if self.has_head:
            loss_ws = loss_working_set(
                self.mb_tokens, self.vocab_local, self.act, t.loss_chunk_size, self.a.dim,
                head_grad,
            )[1]  # fmt: skip
        # Blocks resharded after forward hold nothing here; the root unit (embedding, head) does.
        unsharded = (
            self.unsharded_root
            if (self.fsdp or self.dims.ddp_enabled) and self.reshard
            else self.unsharded_fwd
        )
        if not self.needs_copy:
            unsharded = 0
        acts, grads = self.activations_all, self.carried_grads
        return _Moment(
            acts + loss_ws + unsharded + grads, "loss backward", acts, loss_ws, grads, unsharded
        )

    def _own_grads(self, gathered: int, stored: int) -> int:
        """A block's own gradients: unsharded in the compute dtype before FSDP's
        reduce-scatter, else straight into .grad."""
        if self.pp_fsdp:
            return 0 if self.steady else int(gathered * self.reduce_bytes * self.trained)
        own = gathered * self.act if (self.fsdp or self.act != self.mw) else stored * self.mw
        return int(own * self.trained)

    def _below(self) -> int:
        """Saved activations of the other in-flight microbatches (and the token ids)."""
        if self.plan is None:
            return self.emb_saved
        return self.activations_all - (self.per_mb - self.emb_saved) // max(self.stages, 1)

    def _block_backwards(self) -> tuple[list[_Moment], int]:
        """Each block's backward, last to first (the last in-flight microbatch); also returns
        the gradients the blocks left for the embedding's backward."""
        a, act, mw = self.a, self.act, self.mw
        moments: list[_Moment] = []
        done_grads = 0
        below, blocks = self._below(), sorted(self.layers + self.mtp_layers)
        unsharded = (
            self.unsharded_root + min(2, len(blocks)) * self.unsharded_block
            if self.fsdp and self.reshard
            else self.unsharded_fwd
        )
        for idx in range(len(blocks) - 1, -1, -1):
            i, size = blocks[idx], self.sizes[blocks[idx]]
            lower = sum(self.per_block[j] for j in blocks[:idx])
            recompute = self.full_block[i] if self.modes[i] != "none" else self.per_block[i]
            own = self._own_grads(size.gathered, size.stored)
            if not (self.fsdp or act != mw):
                # Without FSDP each weight gradient lands in .grad as its op's backward runs: at
                # the block's peak (the SwiGLU backward) only the down projection's exists.
                own = min(own, total_elems(self.shapes.block[-4:-3]) * mw)  # w2
            ws = block_backward_bytes(a, self.mb_tokens, act, self.tp) + own
            experts = self._own_grads(size.experts_gathered, size.experts_stored)
            ws += moe_terms.moe_backward_delta(a, i, self.mb_tokens, act, self.tp, experts)
            grads = max(self.carried_grads, done_grads) + self.root_grad
            live = below + lower + recompute
            moments.append(
                _Moment(
                    live + ws + grads + unsharded, f"block backward (layer {i})", live, ws,
                    grads, unsharded,
                )
            )  # fmt: skip
            if self.pp_fsdp:
                done_grads += int(size.gathered * self.reduce_bytes * self.trained)
            elif not self.offload:
                done_grads += int(size.stored * mw * self.trained)
        return moments, done_grads

    def _tower_note(self) -> str:
        tw, t = self.tower, self.cfg.training
        assert tw is not None
        params = total_elems(tuple(tw.shapes))
        return (
            f"vision tower (first stage): {params / 1e6:,.2f} M parameters; "
            f"{t.image_tokens_per_sample} image tokens per sample = {tw.patches} patches per "
            f"microbatch save {format_bytes(tw.saved_bytes)} (every cp rank encodes every "
            "image; replicated across tp)"
        )

    def _tower_backward(self, done_grads: int) -> tuple[list[_Moment], int]:
        """The vision tower's backward (before the embedding's): one of its blocks' working set
        next to the gradients so far and the tower's own, its largest FSDP unit gathered."""
        tw = self.tower
        if tw is None:
            return [], done_grads
        elems = total_elems(tuple(tw.shapes))
        if self.pp_fsdp:
            done_grads += int(elems * self.reduce_bytes * self.trained)
        elif not self.offload:
            done_grads += int(self._stored(tw.shapes) * self.mw * self.trained)
        grads = max(self.carried_grads, done_grads) + self.root_grad
        unsharded = self.unsharded_fwd if self.needs_copy else 0
        if self.fsdp and self.reshard:
            unsharded = self.unsharded_root + tw.largest_unit * self.act
        below, ws = self._below(), tw.backward_bytes
        moment = _Moment(
            below + ws + grads + unsharded, "vision tower backward", below, ws, grads, unsharded
        )
        return [moment], done_grads

    def _embedding_backward(self, done_grads: int) -> list[_Moment]:
        """The embedding's whole gradient (its vocabulary rows under TP), made next to every
        gradient accumulated so far (``done_grads``: the blocks')."""
        if not self.has_embedding:
            return []
        emb = self.shapes.embedding
        new = emb[0] * emb[1] * (self.act if (self.fsdp or self.act != self.mw) else self.mw)
        new = 0 if self.cfg.lora.enable else new  # a frozen embedding has no gradient
        if getattr(self.a, "mtp_depth", 0) > 0:
            # The MTP inputs' lookup makes a second dense gradient, summed into the first.
            new *= 2
        grads = max(self.carried_grads, done_grads) + self.root_grad
        unsharded = self.unsharded_root if self.fsdp and self.reshard else self.unsharded_fwd
        if not self.needs_copy:
            unsharded = 0
        below = self._below()
        return [
            _Moment(
                below + new + grads + unsharded, "embedding backward", below, new, grads,
                unsharded,
            )
        ]  # fmt: skip

    def estimate(self) -> MemoryEstimate:
        """The moment with the most bytes, as a ``MemoryEstimate`` (temporaries 0)."""
        step_new = self.muon_step + self.ft_sync  # Muon's gathers; the cross-group copies
        optimizer = _Moment(
            self.device_grads + step_new, "optimizer step", 0, step_new, self.device_grads, 0,
        )  # fmt: skip
        blocks, done_grads = self._block_backwards()
        tower, done_grads = self._tower_backward(done_grads)
        moments = [
            self._loss_backward(),
            *blocks,
            *tower,
            *self._embedding_backward(done_grads),
            optimizer,
        ]
        peak = max(moments, key=lambda m: m.total)
        return MemoryEstimate(
            parameters=self.parameters,
            gradients=peak.gradients,
            optimizer_states=self.optimizer_states,
            activations=peak.activations,
            unsharded_parameters=peak.unsharded,
            working_set=peak.working_set,
            pipeline_buffers=self.pipeline_buffers,
            temporaries=0,
            phase=peak.phase,
            pp_rank=self.pp_rank,
            in_flight_microbatches=self.in_flight,
            per_microbatch_activations=self.per_mb,
            notes=self.notes,
            host=self.host,
        )
