"""Our model as an lm-evaluation-harness ``LM``, registered as ``torchtitan`` (docs/evaluation.md).

It answers lm-eval's three request types with the semantics of lm-eval's own Hugging Face model
(``HFLM``), so a checkpoint and its HF export score the same:

- ``loglikelihood``: context + continuation tokens, the last ``max_length`` of them, one forward;
  the continuation's summed log-probabilities and whether each of its tokens is the argmax.
  Requests are sorted longest first, right-padded into batches of ``batch_size``.
- ``loglikelihood_rolling``: the text cut into disjoint windows of ``max_length`` tokens after the
  prefix token (lm-eval's window helpers), scored as above and summed per text.
- ``generate_until``: greedy (or, with a temperature, seeded sampling) decoding with the KV cache
  (``models/common/kv_cache.py``), stopping at EOS or a stop string; prompts batched only with
  prompts of the same token length, so no padding enters attention.

Requests are split over the data-parallel ranks and answers gathered back in order
(``eval/requests.py``); tensor-parallel peers run the same requests. lm-eval itself sees one
process (``rank`` 0 of 1) on every rank, so its document handling is the same at any layout.

Importing this module imports lm-eval (an optional dependency: ``pip install torchtitan[eval]``);
the rest of torchtitan imports it only when an evaluation runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.data.tokenizer import AnyTokenizer
from torchtitan.eval.requests import gather, rank_batches
from torchtitan.models.common.kv_cache import KVCache

__all__ = ["TorchTitanLM"]

TokenRequest = tuple[Any, list[int], list[int]]  # (strings or None, context ids, continuation ids)


@register_model("torchtitan")
class TorchTitanLM(TemplateLM):
    """lm-eval's view of a built model (in eval mode, weights loaded) and its tokenizer.

    ``max_length``: the longest sequence the model takes (its RoPE table); ``dp_group``/``dp_rank``
    /``dp_size``: the data-parallel ranks requests are split over (``None``/0/1: none);
    ``add_bos``: start every encoded text with BOS, as training documents do (default: when the
    tokenizer has one)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: AnyTokenizer,
        max_length: int,
        device: torch.device,
        batch_size: int = 8,
        max_gen_toks: int = 256,
        dp_group: dist.ProcessGroup | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        add_bos: bool | None = None,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.model = model
        self.tok = tokenizer
        self._max_length = max_length
        self._device = device
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.dp_group, self.dp_rank, self.dp_size = dp_group, dp_rank, dp_size
        self.bos_id: int | None = getattr(tokenizer, "bos_id", None)
        self.add_bos = self.bos_id is not None if add_bos is None else add_bos
        self.seed = seed

    # ---------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return int(self.tok.eos_id)

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is replaced by: BOS if the tokenizer has one, else EOS."""
        return self.bos_id if self.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        bos = self.add_bos and add_special_tokens is not False
        return self.tok.encode(string, bos=bos, eos=False)

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    # ---------------------------------------------------------------- forward
    @torch.no_grad()
    def _logits(
        self, tokens: torch.Tensor, start: int = 0, cache: KVCache | None = None
    ) -> torch.Tensor:
        """fp32 logits ``[B, S, vocab]`` of ``tokens`` at positions ``start ..``; under loss
        parallel (training-time TP) the vocabulary shards are gathered."""
        if cache is None:
            out = self.model(tokens)
        else:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
            out = self.model(tokens, positions=positions, cache=cache)
        if isinstance(out, DTensor):
            out = out.full_tensor()
        return out.float()

    # ---------------------------------------------------------------- loglikelihood
    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        mine = rank_batches(
            requests, lambda r: len(r[1]) + len(r[2]), self.batch_size, self.dp_rank, self.dp_size
        )
        answers: list[tuple[int, tuple[float, bool]]] = []
        for group in mine:
            answers += self._score_batch(group)
        return gather(answers, len(requests), self.dp_group, self.dp_size)

    def _score_batch(
        self, group: list[tuple[int, TokenRequest]]
    ) -> list[tuple[int, tuple[float, bool]]]:
        rows = []
        for _, (_, context, continuation) in group:
            if not continuation or len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens cannot be scored with "
                    f"max_length {self.max_length}"
                )
            # The last max_length tokens of context + continuation, minus the final one.
            rows.append(((context + continuation)[-(self.max_length + 1) :][:-1], continuation))
        width = max(len(inp) for inp, _ in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for b, (inp, _) in enumerate(rows):
            batch[b, : len(inp)] = torch.tensor(inp)
        logp = F.log_softmax(self._logits(batch.to(self._device)), dim=-1).cpu()
        out = []
        for b, ((index, _), (inp, cont)) in enumerate(zip(group, rows)):
            picked = logp[b, len(inp) - len(cont) : len(inp)]
            target = torch.tensor(cont)
            score = float(picked.gather(-1, target[:, None]).sum())
            greedy = bool((picked.argmax(dim=-1) == target).all())
            out.append((index, (score, greedy)))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[TokenRequest] = []
        owners: list[int] = []
        for i, request in enumerate(requests):
            (text,) = request.args
            for context, target in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, target))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += score
        return totals

    # ---------------------------------------------------------------- generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        prompts = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            eos = self.tok.decode([self.eot_token_id])
            until = handle_stop_sequences(kwargs.pop("until", None), eos)
            room = self.max_length - kwargs["max_gen_toks"]
            if room <= 0:
                raise ValueError(
                    f"max_gen_toks {kwargs['max_gen_toks']} leaves no room for a prompt within "
                    f"max_length {self.max_length}"
                )
            ids = self.tok_encode(context)[-room:]
            prompts.append((ids, until, kwargs))
        mine = rank_batches(
            prompts,
            lambda p: len(p[0]),
            self.batch_size,
            self.dp_rank,
            self.dp_size,
            same_length=_generation_key,
        )
        answers: list[tuple[int, str]] = []
        for group in mine:
            answers += self._generate_batch(group)
        return gather(answers, len(requests), self.dp_group, self.dp_size)

    def _generate_batch(self, group: list[tuple[int, Any]]) -> list[tuple[int, str]]:
        _, until, kwargs = group[0][1]
        max_new = int(kwargs["max_gen_toks"])
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        generator = torch.Generator().manual_seed(self.seed) if temperature > 0 else None
        tokens = torch.tensor([p[0] for _, p in group], dtype=torch.long, device=self._device)
        cache = KVCache(tokens.shape[1] + max_new)
        new: list[list[int]] = [[] for _ in group]
        done = [False] * len(group)
        logits = self._logits(tokens, 0, cache)[:, -1]
        for step in range(max_new):
            nxt = _pick(logits, temperature, generator).tolist()
            for b, token in enumerate(nxt):
                if done[b]:
                    continue
                if token == self.eot_token_id:
                    done[b] = True
                    continue
                new[b].append(token)
                done[b] = any(s and s in self.tok_decode(new[b]) for s in until)
            if all(done) or step == max_new - 1:
                break
            step_ids = torch.tensor(nxt, dtype=torch.long, device=self._device)[:, None]
            logits = self._logits(step_ids, cache.length, cache)[:, -1]
        return [
            (index, postprocess_generated_text(self.tok_decode(ids), until, None))
            for (index, _), ids in zip(group, new)
        ]


def _generation_key(prompt: tuple[list[int], list[str], dict[str, Any]]) -> object:
    """Prompts batched together: same token length and same generation settings."""
    ids, until, kwargs = prompt
    return (len(ids), tuple(until), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))


def _pick(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Next ids from last-position logits: argmax, or a seeded sample at ``temperature``."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
