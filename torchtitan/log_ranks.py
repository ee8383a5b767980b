"""``python -m torchtitan.log_ranks LOG_RANK WORLD_SIZE [config args]``: print the global ranks
that ``LOG_RANK`` names, comma-separated. ``run_train.sh`` passes the result to torchrun's
output filter, so ``LOG_RANK=last`` can show the ranks that hold the last pipeline stage."""

from __future__ import annotations

import contextlib
import sys

from torchtitan.config.errors import ConfigError
from torchtitan.distributed.pipeline_stages import PipelineStages
from torchtitan.planner.auto import load_config
from torchtitan.preflight.validate import pipeline_stages


def resolve_log_ranks(spec: str, world_size: int, plan: PipelineStages | None) -> list[int]:
    """``LOG_RANK`` -> sorted global ranks: a comma list of ranks and the words ``last`` (the
    ranks holding the last pipeline stage, where the loss is computed; every rank without PP)
    and ``all``."""
    ranks: set[int] = set()
    for item in (s.strip() for s in spec.split(",")):
        if item == "all":
            ranks.update(range(world_size))
        elif item == "last":
            ranks.update(plan.last_stage_global_ranks(world_size) if plan else range(world_size))
        elif item.isdigit() and int(item) < world_size:
            ranks.add(int(item))
        else:
            raise ValueError(
                f"LOG_RANK item {item!r} is not a rank below {world_size}, 'last' or 'all'"
            )
    return sorted(ranks)


def main(argv: list[str]) -> int:
    spec, world_size = argv[0], int(argv[1])
    plan = None
    # A config error is the trainer's to report; 'last' then falls back to no-PP.
    with contextlib.suppress(ConfigError):
        plan = pipeline_stages(load_config(argv[2:], world_size=world_size)[0])
    try:
        print(",".join(map(str, resolve_log_ranks(spec, world_size, plan))))
    except ValueError as e:
        print(f"run_train.sh: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
