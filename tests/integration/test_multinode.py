"""Two "nodes" on localhost: scripts/multinode_trainer.slurm runs twice (SLURM's commands stood in
for), so two torchrun agents (torchtitan.launch, 2 ranks each) meet through a c10d rendezvous
exactly as on a cluster, and train the debug model with TP 2 inside each node x FSDP 2 across the
nodes. The per-step losses must equal a single-node 4-rank run of the same layout (forked ranks,
tests/launcher.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launcher import free_port
from tests.parity import (
    DEBUG_TOML,
    FSDP2_TP2,
    TINY,
    assert_losses_match,
    losses,
    read_jsonl,
    train_metrics,
)

STEPS = 5
# TP 2 inside a node, FSDP 2 across the nodes; 4 sequences per data-parallel rank (global 8).
LAYOUT = [*FSDP2_TP2, "--training.local_batch_size", "4"]


def _node(port: int, dump: Path, log: Path) -> subprocess.Popen:
    """One "node": scripts/multinode_trainer.slurm as sbatch runs it, with stand-ins for SLURM's
    ``scontrol`` (the allocation is localhost) and ``srun`` (runs its command here)."""
    root = Path(DEBUG_TOML).parents[1]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TORCHTITAN_PYTHON=sys.executable,
        CONFIG_FILE=DEBUG_TOML,
        GPUS_PER_NODE="2",
        RDZV_PORT=str(port),
        LOG_RANK="0,1",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID=f"multinode-test-{port}",
        **{
            "BASH_FUNC_scontrol%%": "() { echo localhost; }",
            "BASH_FUNC_srun%%": '() { while [[ "$1" == -* ]]; do shift; done; "$@"; }',
        },
    )
    # torchrun's MASTER_* would otherwise leak in from a test run under torchrun.
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    cmd = ["bash", str(root / "scripts" / "multinode_trainer.slurm"), "--job.dump_folder"]
    cmd += [str(dump), *TINY, "--training.steps", str(STEPS), *LAYOUT]
    # A session of its own, so that a hung run can be killed with its ranks. The child keeps
    # its own copy of the log's descriptor; ours is closed once it has started.
    with log.open("w") as out:
        return subprocess.Popen(
            cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


@pytest.mark.slow
@pytest.mark.smoke
def test_two_nodes_match_one_node(tmp_path: Path) -> None:
    port = free_port()
    dump = tmp_path / "two_nodes"
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [_node(port, dump, logs[0])]
    time.sleep(1.0)  # the first node binds the rendezvous port; the second then joins it
    nodes.append(_node(port, dump, logs[1]))
    try:
        codes = [p.wait(timeout=600) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    full = [log.read_text() for log in logs]
    text = "\n".join(f"--- node {i}\n" + t[-3000:] for i, t in enumerate(full))
    assert codes == [0, 0], text
    # Each agent started 2 ranks; together they are one world of 4, and each node holds one
    # whole TP group (ranks 2k, 2k+1: tp innermost), so only FSDP crosses the nodes.
    held = [sorted({int(r) for r in re.findall(r"\[rank (\d) dp_shard", t)}) for t in full]
    print("ranks per node:", held)
    assert sorted(held) == [[0, 1], [2, 3]], text
    assert all("world size 4" in t for t in full), text
    two_nodes = read_jsonl(dump / "metrics" / "rank_0.jsonl")
    assert [m["step"] for m in two_nodes] == list(range(1, STEPS + 1))

    one_node = train_metrics(LAYOUT, world_size=4, dump=tmp_path / "one_node", steps=STEPS)
    print("2 nodes x 2 ranks losses:", " ".join(f"{x:.6f}" for x in losses(two_nodes)))
    print("1 node x 4 ranks losses: ", " ".join(f"{x:.6f}" for x in losses(one_node)))
    assert_losses_match(
        losses(one_node), losses(two_nodes), rtol=1e-5, label="2 nodes x 2 vs 1 x 4"
    )


def test_slurm_script_composes_the_torchrun_line() -> None:
    """The sbatch script under stand-in ``scontrol``/``srun``: head node, node count, ranks per
    node, rendezvous and overrides reach the torchrun command line."""
    env = dict(
        os.environ,
        # Exported bash functions stand in for the SLURM commands (no files to exec).
        **{
            "BASH_FUNC_scontrol%%": "() { printf 'gpu-a17\\ngpu-a18\\n'; }",
            "BASH_FUNC_srun%%": '() { printf "%s\\n" "$@"; }',
        },
        SLURM_JOB_NODELIST="gpu-a[17-18]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="4242",
        CONFIG_FILE="train_configs/llama3_70b.toml",
        GPUS_PER_NODE="4",
        MAX_RESTARTS="3",
    )
    script = Path(DEBUG_TOML).parents[1] / "scripts" / "multinode_trainer.slurm"
    proc = subprocess.run(
        ["bash", str(script), "--training.steps", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.split("\n")

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert value("--nnodes") == "2" and value("--nproc_per_node") == "4"
    assert value("--rdzv_backend") == "c10d" and value("--rdzv_endpoint") == "gpu-a17:29500"
    assert value("--rdzv_id") == "4242" and value("--max-restarts") == "3"
    assert value("--job.config_file") == "train_configs/llama3_70b.toml"
    assert args[args.index("-m") + 1] == "torchtitan.launch"  # torchrun with our exit codes
    assert args[-3:-1] == ["--training.steps", "3"]
