"""The data loader of one data-parallel rank, as ``[training]`` and ``[sft]`` say: sharded by
the rank's data-parallel coordinate only (TP, CP and PP peers read the same batches); the
trainer's and the validator's (docs/data.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.job_config import Training
from torchtitan.config.sections import Sft
from torchtitan.data.builder import DataOptions, build_data_loader, mixture_source, source_label
from torchtitan.data.chat_data import ChatDataset
from torchtitan.data.chat_template import resolve_chat_template
from torchtitan.data.dataloader import ParallelAwareDataloader
from torchtitan.data.tokenizer import AnyTokenizer
from torchtitan.data.vlm_dataset import VLMDataset, collate, image_tokens, source_files
from torchtitan.data.vlm_images import ImageRules, NavitRules
from torchtitan.data.vlm_mixture import ImageTextSource, RawIndex, VLMMixtureDataset


def rank_dataloader(
    training: Training,
    sft: Sft,
    tokenizer: AnyTokenizer,
    dp_mesh: DeviceMesh,
    *,
    dataset: str,
    dataset_path: str | None,
    split: str,
    infinite: bool,
    seed: int,
    with_doc_ids: bool,
    model_args: Any = None,
    shard: tuple[int, int] | None = None,
) -> ParallelAwareDataloader:
    """``dataset`` at ``dataset_path`` (the training or the validation set) for this rank of
    ``dp_mesh``; ``with_doc_ids`` (block_causal attention) adds each token's document id;
    ``model_args`` (image-text data only: :func:`uses_images`): the run's model args (its
    vision settings and image token ids);
    ``shard``: the (data rank, data world) to read instead of ``dp_mesh``'s (fault-tolerant
    replica groups each read their own share: docs/fault_tolerance.md)."""
    t = training
    if dataset == "chat":  # chat SFT rows with prompt-masked labels (docs/sft.md)
        return chat_dataloader(t, sft, dataset_path, tokenizer, dp_mesh, infinite, with_doc_ids)
    if dataset == "vlm":  # image-text samples (docs/vlm.md)
        return vlm_dataloader(t, sft, dataset_path, tokenizer, dp_mesh, infinite, model_args)
    if uses_images(t, dataset):  # image-text and text sources at weights (docs/vlm.md)
        return vlm_mixture_dataloader(t, sft, tokenizer, dp_mesh, seed, model_args, shard)
    return build_data_loader(
        dataset=dataset,
        dataset_path=dataset_path,
        tokenizer=tokenizer,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=shard[0] if shard else dp_mesh.get_local_rank(),
        dp_world_size=shard[1] if shard else dp_mesh.size(),
        split=split,
        infinite=infinite,
        sharding=t.data_sharding,
        with_doc_ids=with_doc_ids,
        options=DataOptions(t.tokenized_shuffle, seed, t.mixture, t.mixture_exhausted),
    )


def chat_dataloader(
    training: Training,
    sft: Sft,
    path: str | None,
    tokenizer: AnyTokenizer,
    dp_mesh: DeviceMesh,
    infinite: bool,
    with_doc_ids: bool,
) -> ParallelAwareDataloader:
    """The ``chat`` dataset's loader for this data-parallel rank (``[sft]`` options)."""
    assert path is not None  # preflight requires a dataset_path for "chat"
    rank, world = dp_mesh.get_local_rank(), dp_mesh.size()
    chat = ChatDataset(
        path,
        tokenizer,
        training.seq_len,
        dp_rank=rank,
        dp_world_size=world,
        infinite=infinite,
        packing=sft.packing,
        overlong=sft.overlong,
        template=sft.chat_template,
        with_doc_ids=with_doc_ids,
    )
    return ParallelAwareDataloader(chat, rank, world, batch_size=training.local_batch_size)


def uses_images(training: Training, dataset: str) -> bool:
    """Whether ``dataset`` is image-text data (``vlm``, or a mixture with a ``vlm`` source):
    its loader needs the run's model args."""
    mixed = dataset == "mixture" and any(s.dataset == "vlm" for s in training.mixture)
    return dataset == "vlm" or mixed


def image_rules(model_args: Any) -> ImageRules | NavitRules:
    """How the run's tower wants its images: Qwen-VL's rules, or MoonViT's (Kimi K2.5,
    ``vlm_images.py: NavitRules``) when the tower says so."""
    v = model_args.vision
    if getattr(v, "processor", "qwen") == "navit":
        return NavitRules(v.patch_size, v.spatial_merge_size)
    return ImageRules(v.patch_size, v.spatial_merge_size, v.temporal_patch_size)


def vlm_dataloader(
    training: Training,
    sft: Sft,
    path: str | None,
    tokenizer: AnyTokenizer,
    dp_mesh: DeviceMesh,
    infinite: bool,
    model_args: Any,
) -> ParallelAwareDataloader:
    """The ``vlm`` dataset's loader: patches and placeholders by the run's model args (its
    tower's sizes, ``vlm_dataset.py: image_tokens``; preflight: validate_samples.py); batches
    are dicts (``vlm_dataset.py: collate``)."""
    assert path is not None  # preflight requires a dataset_path for "vlm"
    rules, ids = image_rules(model_args), image_tokens(model_args)
    rank, world = dp_mesh.get_local_rank(), dp_mesh.size()
    template = resolve_chat_template(tokenizer, sft.chat_template)  # chat samples
    data = VLMDataset(
        source_files(Path(path)), tokenizer, training.seq_len, rules, ids, rank, world, infinite,
        template,
    )  # fmt: skip
    batch = training.local_batch_size
    return ParallelAwareDataloader(data, rank, world, batch_size=batch, collate_fn=collate)


def vlm_mixture_dataloader(
    training: Training,
    sft: Sft,
    tokenizer: AnyTokenizer,
    dp_mesh: DeviceMesh,
    seed: int,
    model_args: Any,
    shard: tuple[int, int] | None = None,
) -> ParallelAwareDataloader:
    """A ``mixture`` with ``dataset = "vlm"`` sources: image-text samples and text windows at
    the tables' weights, rows of :class:`VLMMixtureDataset` (``data/vlm_mixture.py``), for
    ``shard`` (data rank, data world) or ``dp_mesh``'s rank (window sharding, as text mixtures)."""
    t, rules, ids = training, image_rules(model_args), image_tokens(model_args)
    opts = DataOptions(t.tokenized_shuffle, seed, t.mixture, t.mixture_exhausted)
    sources: list[Any] = []
    for i, src in enumerate(t.mixture):
        if src.dataset != "vlm":
            sources.append(mixture_source(i, src, tokenizer, t.seq_len, opts))
            continue
        template = resolve_chat_template(tokenizer, sft.chat_template)
        builder = VLMDataset([], tokenizer, t.seq_len, rules, ids, template=template)
        index = RawIndex(source_files(Path(src.path)))
        sources.append(ImageTextSource(source_label(src), index, builder, t.mixture_exhausted))
    rank, world = shard if shard else (dp_mesh.get_local_rank(), dp_mesh.size())
    weights = [s.weight for s in t.mixture]
    data = VLMMixtureDataset(sources, weights, t.seq_len, rules.patch_dim, rank, world)
    batch = training.local_batch_size
    return ParallelAwareDataloader(data, rank, world, batch_size=batch, collate_fn=collate)
