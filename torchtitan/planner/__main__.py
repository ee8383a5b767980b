"""``python -m torchtitan.planner --job.config_file F --world_size N --device_memory_gib M [...]``.

Enumerates parallel layouts for the config's model and global batch on ``N`` devices, drops
those whose memory estimate does not fit, and prints the fastest (see
``torchtitan/planner/cost_model.py`` for the cost model) with the override line that runs each.

Planner options (everything else is a config override, as for ``torchtitan.train``):
  --world_size N            devices in the job (required)
  --device_memory_gib M     memory per device (required)
  --nodes K                 nodes (default: N / 8, at least 1); devices per node = N / K
  --top T                   layouts to print (default 5)
  --device NAME             look the dense bf16 peak up in the datasheet table (default H100 SXM)
  --peak_tflops X           peak TFLOP/s per device instead of --device
  --mfu F                   fraction of the peak the matmuls reach (default 0.5)
  --intra_node_gbps B       collective bandwidth per device inside a node, GB/s (default 450)
  --inter_node_gbps B       ... across nodes, GB/s (default 25)
  --host_device_gbps B      host-device bandwidth per device for CPU offload, GB/s (default 25)
  --host_memory_gbps B      host memory bandwidth per device for the CPU optimizer step (default 10)
  --vocab_size V            vocabulary for the estimate (default: the tokenizer's, else the flavor's)
  --document_lengths FILE   token lengths of the training documents (integers, one per line or
                            comma-separated): with model.attn_mask_type block_causal, CP layouts
                            pay for their slowest rank's attention under the configured
                            parallelism.context_parallel_load_balancer (docs/context_parallel.md)
Exit status: 0 with at least one fitting layout, 1 when none fits, 2 on a bad argument.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.models import MODELS
from torchtitan.planner.auto import device_peak_tflops
from torchtitan.planner.estimator import format_bytes, model_args_for
from torchtitan.planner.planner import Hardware, plan, summary

# option -> (type, the smallest value, whether the smallest is excluded, the fix)
_OPTIONS: dict[str, tuple[type, float, bool, str]] = {
    "--world_size": (int, 1, False, "give the devices of the job, e.g. --world_size 8"),
    "--device_memory_gib": (float, 0, True, "give one device's memory, e.g. 80 for an H100"),
    "--nodes": (int, 1, False, "give the nodes, a divisor of --world_size"),
    "--top": (int, 1, False, "use e.g. --top 5"),
    "--device": (str, 0, False, ""),
    "--peak_tflops": (float, 0, True, "give the dense bf16 peak, e.g. 989 for an H100 SXM"),
    "--mfu": (float, 0, True, "use a fraction in (0, 1], e.g. 0.5"),
    "--intra_node_gbps": (float, 0, True, "use e.g. 450"),
    "--inter_node_gbps": (float, 0, True, "use e.g. 25"),
    "--host_device_gbps": (float, 0, True, "use e.g. 25"),
    "--host_memory_gbps": (float, 0, True, "use e.g. 10"),
    "--vocab_size": (int, 1, False, "leave it out (the tokenizer's), or give e.g. 128256"),
    "--document_lengths": (str, 0, False, ""),
}


def _convert(key: str, text: str) -> object:
    """``text`` as option ``key``'s value, in range (ConfigError naming the option if not)."""
    kind, low, open_low, fix = _OPTIONS[key]
    try:
        value = kind(text)
    except ValueError:
        rule = f"must be {'an integer' if kind is int else 'a number'}"
        raise ConfigError(key, text, rule, fix) from None
    if kind is str:
        return value
    assert isinstance(value, (int, float))
    if not math.isfinite(value) or value < low or (open_low and value == low):
        what = "an integer" if kind is int else "a finite number"
        rule = f"must be {what} {'>' if open_low else '>='} {low:g}"
        raise ConfigError(key, value, rule, fix)
    if key == "--mfu" and value > 1:
        raise ConfigError(key, value, "must be in (0, 1] (a fraction of the peak)", fix)
    return value


def _take_options(argv: list[str]) -> tuple[dict[str, object], list[str]]:
    found: dict[str, object] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        key, _, inline = argv[i].partition("=")
        if key in _OPTIONS:
            text = inline if inline else (argv[i + 1] if i + 1 < len(argv) else "")
            found[key[2:]] = _convert(key, text)
            i += 1 if inline else 2
        else:
            rest.append(argv[i])
            i += 1
    return found, rest


def _nodes(opts: dict[str, object], world_size: int) -> int:
    """``--nodes`` (default: world size / 8, at least 1), which must divide the world size."""
    nodes = int(opts.get("nodes", max(1, world_size // 8)))  # type: ignore[call-overload]
    if world_size % nodes:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            "--nodes",
            nodes,
            f"must divide --world_size {world_size} (the same devices on every node)",
            f"use one of {', '.join(map(str, fits[:12]))}",
        )
    return nodes


def document_lengths(path: str, seq_len: int) -> tuple[int, ...]:
    """The ``--document_lengths`` file's lengths; each from 1 to ``seq_len`` (ConfigError)."""
    field = "--document_lengths"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(field, path, f"cannot be read ({e.strerror})", "give a file") from None
    words = text.replace(",", " ").split()
    if not words or not all(w.isdigit() for w in words):
        bad = next((w for w in words if not w.isdigit()), "nothing")
        rule = f"must hold positive integers, one per line or comma-separated (found {bad!r})"
        raise ConfigError(field, path, rule, "write one document's token count per line")
    lengths = tuple(int(w) for w in words)
    worst = max(lengths)
    if min(lengths) < 1 or worst > seq_len:
        n = worst if worst > seq_len else min(lengths)
        raise ConfigError(
            field,
            path,
            f"holds a document of {n} tokens; each must be 1..training.seq_len = {seq_len} "
            "(the cost is per window of seq_len tokens)",
            "split longer documents into seq_len pieces, or raise --training.seq_len",
        )
    return lengths


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        opts, rest = _take_options(argv)
        for required in ("world_size", "device_memory_gib"):
            if required not in opts:
                raise ConfigError(
                    f"--{required}", None, "is required", _OPTIONS[f"--{required}"][3]
                )
        world_size = int(opts["world_size"])  # type: ignore[call-overload]
        nodes = _nodes(opts, world_size)
        peak = (
            float(opts["peak_tflops"])  # type: ignore[arg-type]
            if "peak_tflops" in opts
            else device_peak_tflops(str(opts.get("device", "H100 SXM")))
        )
        hw = Hardware(
            memory_gib=float(opts["device_memory_gib"]),  # type: ignore[arg-type]
            peak_tflops=peak,
            gpus_per_node=world_size // nodes,
        )
        for name in (
            "mfu",
            "intra_node_gbps",
            "inter_node_gbps",
            "host_device_gbps",
            "host_memory_gbps",
        ):
            if name in opts:
                hw = replace(hw, **{name: float(opts[name])})  # type: ignore[arg-type]
        cfg = parse_args(rest)
        if "document_lengths" in opts:
            lengths = document_lengths(str(opts["document_lengths"]), cfg.training.seq_len)
            hw = replace(hw, document_lengths=lengths)
        vocab = opts.get("vocab_size")
        args = model_args_for(cfg, vocab_size=int(vocab) if vocab is not None else None)  # type: ignore[call-overload]
        results, n_layouts, too_big = plan(cfg, args, world_size, hw)
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    top = int(opts.get("top", 5))  # type: ignore[call-overload]
    print(
        f"{cfg.model.name} {cfg.model.flavor} ({MODELS[cfg.model.name].num_params(args) / 1e9:.2f} B parameters, vocab "
        f"{args.vocab_size}), seq_len {cfg.training.seq_len}, global batch "
        f"{results[0].layout.global_batch_size if results else '?'} sequences on {world_size} "
        f"devices ({nodes} node(s) x {hw.gpus_per_node}), {hw.memory_gib:g} GiB and "
        f"{hw.peak_tflops:g} TFLOP/s each"
    )
    print(
        f"{n_layouts} layouts enumerated, {too_big} do not fit in "
        f"{(1 - hw.headroom) * hw.memory_gib:.0f} GiB ({hw.headroom:.0%} headroom), "
        f"{len(results)} ranked"
    )
    if not results:
        print(
            "no layout fits, even with the memory levers (chunked loss, bf16 moments, CPU "
            "offload): more devices, more memory per device, or a shorter sequence"
        )
        return 1
    for line in summary(cfg, results):
        print(line)
    for i, r in enumerate(results[:top], start=1):
        print(
            f"\n#{i}  {r.layout.describe()}\n"
            f"    predicted {r.tokens_per_s_per_device:,.0f} tokens/s per device, step "
            f"{r.step_time_s:.2f} s, memory {format_bytes(r.memory.total)} per device"
        )
        for reason in r.reasons:
            print(f"    - {reason}")
        print("    run with: " + " ".join(r.layout.overrides()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
