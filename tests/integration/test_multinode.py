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


def _slurm_env(port: int, nodes: int, gpus: int, **extra: str) -> dict[str, str]:
    """The environment sbatch gives scripts/multinode_trainer.slurm, with stand-ins for SLURM's
    ``scontrol`` (the allocation is localhost) and ``srun`` (runs its command here)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TORCHTITAN_PYTHON=sys.executable,
        CONFIG_FILE=DEBUG_TOML,
        GPUS_PER_NODE=str(gpus),
        RDZV_PORT=str(port),
        LOG_RANK=",".join(str(r) for r in range(gpus)),
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_JOB_ID=f"multinode-test-{port}",
        **{
            "BASH_FUNC_scontrol%%": "() { echo localhost; }",
            "BASH_FUNC_srun%%": '() { while [[ "$1" == -* ]]; do shift; done; "$@"; }',
        },
    )
    env.update(extra)
    # torchrun's MASTER_* would otherwise leak in from a test run under torchrun.
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def _sbatch(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen:
    """scripts/multinode_trainer.slurm as sbatch runs it on one node, its output in ``log``.
    A session of its own, so that a hung run can be killed with its ranks. The child keeps its
    own copy of the log's descriptor; ours is closed once it has started."""
    root = Path(DEBUG_TOML).parents[1]
    cmd = ["bash", str(root / "scripts" / "multinode_trainer.slurm"), *args]
    with log.open("w") as out:
        return subprocess.Popen(
            cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _node(port: int, dump: Path, log: Path) -> subprocess.Popen:
    """One "node" of two, 2 ranks each."""
    args = ["--job.dump_folder", str(dump), *TINY, "--training.steps", str(STEPS), *LAYOUT]
    return _sbatch(_slurm_env(port, nodes=2, gpus=2), log, *args)


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.slow
def test_slurm_starts_the_lighthouse_for_two_replica_groups(tmp_path: Path) -> None:
    """TORCHFT_LIGHTHOUSE=start under the SLURM stand-ins (one node, one rank): the script
    starts torchft's lighthouse on the head node and prints where it listens; that job is
    replica group 0, and group 1 is a run_train.sh pointed at the printed address. Both train
    3 steps with their gradients averaged across the groups: their final weights are equal bit
    for bit though each group reads its own data. The lighthouse stops with the job (the test
    kills it if it did not)."""
    pytest.importorskip("torchft")
    import torch

    from tests.checkpoint_helpers import read_checkpoint
    from tests.ft_helpers import ARGS, Replica, wait_for

    steps = "3"
    common = (*ARGS, "--training.steps", steps, "--checkpoint.enable")
    common += ("--fault_tolerance.min_replicas", "2", "--fault_tolerance.quorum_timeout_seconds")
    common += ("300",)  # the first quorum waits for the other group's start-up
    env = _slurm_env(
        free_port(),
        nodes=1,
        gpus=1,
        TORCHFT_LIGHTHOUSE="start",
        LIGHTHOUSE_PORT=str(free_port()),
        LIGHTHOUSE_MIN_REPLICAS="2",
        LIGHTHOUSE_LOG=str(tmp_path / "lighthouse.log"),
    )
    log, dump = tmp_path / "slurm.log", tmp_path / "slurm_group0"
    group0 = _sbatch(
        env, log, "--job.dump_folder", str(dump), "--fault_tolerance.enable",
        "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "0", *common,
    )  # fmt: skip
    listening = re.compile(r"torchft lighthouse \(pid (\d+)\) listening on (http://\S+);")
    pid = 0
    group1 = None
    try:
        end = time.monotonic() + 60
        while (found := listening.search(log.read_text())) is None:
            assert time.monotonic() < end and group0.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        pid, address = int(found[1]), found[2]
        assert address == f"http://localhost:{env['LIGHTHOUSE_PORT']}"  # the head node's
        assert _pid_alive(pid)
        group1 = Replica(tmp_path, 1, 2, 1, address, *common)
        assert group0.wait(timeout=600) == 0, log.read_text()[-4000:]
        assert group1.wait(600) == 0, group1.text()[-4000:]
        wait_for(lambda: not _pid_alive(pid), 10, "the lighthouse's exit", [])
    finally:
        if group0.poll() is None:
            os.killpg(group0.pid, signal.SIGKILL)
        if group1 is not None and group1.proc.poll() is None:
            group1.sigkill()
        if pid and _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert "fault tolerance: replica group 0 of 2" in text, text[-3000:]
    assert [m["step"] for m in read_jsonl(dump / "metrics" / "rank_0.jsonl")] == [1, 2, 3]
    models = [
        {
            k: v
            for k, v in read_checkpoint(d / "checkpoint" / "step-3").items()
            if k.startswith("model.")
        }
        for d in (dump, group1.folder)
    ]
    assert set(models[0]) == set(models[1]) and len(models[0]) > 10
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_slurm_lighthouse_that_cannot_start_stops_the_job(tmp_path: Path) -> None:
    """TORCHFT_LIGHTHOUSE=start on a port already taken: one line naming the port and the fix,
    exit 2, and no training started (srun is never reached)."""
    pytest.importorskip("torchft")
    import socket

    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _slurm_env(
            free_port(),
            nodes=1,
            gpus=1,
            TORCHFT_LIGHTHOUSE="start",
            LIGHTHOUSE_PORT=str(port),
            LIGHTHOUSE_LOG=str(tmp_path / "lighthouse.log"),
            **{"BASH_FUNC_srun%%": "() { echo SRUN; }"},
        )
        script = Path(DEBUG_TOML).parents[1] / "scripts" / "multinode_trainer.slurm"
        proc = subprocess.run(
            ["bash", str(script)], env=env, capture_output=True, text=True, timeout=120
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "SRUN" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"did not start on port {port}" in lines[0], proc.stderr
    assert "Address already in use" in lines[0] and "Fix: free the port" in lines[0]
