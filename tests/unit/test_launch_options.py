"""The launch scripts pass torchrun only options the oldest torch of the window accepts.

``run_train.sh`` and ``scripts/multinode_trainer.slurm`` hand their torchrun options to
``python -m torchtitan.launch``; torch 2.11's torchrun refusing one (``--shutdown-timeout``, new in
2.13) made every launch exit 2 there. Each script runs here with stand-ins for python / srun that
print the launcher's arguments; those go through ``torchtitan.launch``'s parser built on torch
2.11's recorded torchrun options, so no 2.11 venv is needed. The record is checked against the
installed torch wherever it is one of the recorded versions (2.13 here, 2.11 and 2.15 in the
smoke tier, ``./run_tests.sh --torch``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
from pathlib import Path

import pytest
import torch.distributed.run as torchrun

from torchtitan import launch
from torchtitan.tools import torch_compat

ROOT = Path(__file__).resolve().parents[2]


def _options(text: str) -> list[str]:
    return text.split()


# torchrun's options per torch version, recorded from each venv with
#   python -c "from torch.distributed.run import get_args_parser as g
#   a = [x for x in g()._actions if x.option_strings]
#   print(sorted(o for x in a for o in x.option_strings if x.nargs != 0))  # nargs == 0: switches"
# (torch 2.11.0+cu130, 2.13.0+cpu, 2.15.0+cu132; every version has the same switches).


SWITCHES = _options(
    "--help --module --no-python --no_python --run-path --run_path --standalone \
--virtual-local-rank --virtual_local_rank -h -m"
)
VALUED_2_11 = _options(
    "--duplicate-stderr-filters --duplicate-stdout-filters \
--duplicate_stderr_filters --duplicate_stdout_filters --event-log-handler --event_log_handler \
--local-addr --local-ranks-filter --local_addr --local_ranks_filter --log-dir --log_dir \
--logs-specs --logs_specs --master-addr --master-port --master_addr --master_port --max-restarts \
--max_restarts --monitor-interval --monitor_interval --nnodes --node-rank --node_rank \
--nproc-per-node --nproc_per_node --numa-binding --numa_binding --rdzv-backend --rdzv-conf \
--rdzv-endpoint --rdzv-id --rdzv_backend --rdzv_conf --rdzv_endpoint --rdzv_id --redirects \
--role --signals-to-handle --signals_to_handle --start-method --start_method --tee -r -t"
)
VALUED_2_13 = [*VALUED_2_11, "--shutdown-timeout", "--shutdown_timeout"]
VALUED_2_15 = VALUED_2_13 + _options(
    "--log-line-prefix-template --log_line_prefix_template \
--print-completion --print_completion"
)
TORCHRUN_VALUED = {(2, 11): VALUED_2_11, (2, 13): VALUED_2_13, (2, 15): VALUED_2_15}
OLDEST = torch_compat.MIN_TORCH


@pytest.mark.smoke
def test_recorded_torchrun_options_are_the_installed_ones() -> None:
    if torch_compat.TORCH_VERSION not in TORCHRUN_VALUED:
        pytest.skip(f"no record of torchrun's options for torch {torchrun.torch.__version__}")
    actions = [a for a in torchrun.get_args_parser()._actions if a.option_strings]
    valued = {o for a in actions if a.nargs != 0 for o in a.option_strings}
    switches = {o for a in actions if a.nargs == 0 for o in a.option_strings}
    assert valued == set(TORCHRUN_VALUED[torch_compat.TORCH_VERSION])
    assert switches == set(SWITCHES)
    assert ("--shutdown-timeout" in valued) == torch_compat.TORCHRUN_SHUTDOWN_TIMEOUT


def _recorded_parser(version: tuple[int, int]) -> argparse.ArgumentParser:
    """A parser with torchrun's options of ``version`` (as recorded) and its positionals."""
    short = {"-h": "help", "-m": "module", "-r": "redirects", "-t": "tee"}

    def dest(option: str) -> str:
        return short.get(option) or option.lstrip("-").replace("-", "_")

    parser = argparse.ArgumentParser(add_help=False)
    for option in TORCHRUN_VALUED[version]:
        parser.add_argument(option, dest=dest(option))
    for option in SWITCHES:
        parser.add_argument(option, dest=dest(option), action="store_true")
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _launch_argv(script: str, tmp_path: Path) -> list[str]:
    """The arguments ``script`` gives ``python -m torchtitan.launch`` (stand-in python / srun)."""
    python = tmp_path / "python"
    python.write_text(
        '#!/usr/bin/env bash\n[[ "$1 $2" == "-m torchtitan.launch" ]] && printf "%s\\n" "$@"\n'
        "exit 0\n"
    )
    python.chmod(0o755)
    env = dict(
        os.environ,
        NGPU="2",
        OMP_NUM_THREADS="1",
        TORCHTITAN_PYTHON=str(python),
        SLURM_JOB_NODELIST="gpu-a[17-18]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="4242",
        **{
            "BASH_FUNC_scontrol%%": "() { printf 'gpu-a17\\ngpu-a18\\n'; }",
            "BASH_FUNC_srun%%": '() { while [[ "$1" == -* ]]; do shift; done; "$@"; }',
        },
    )
    env.pop("SHUTDOWN_TIMEOUT", None)
    env.pop("TORCHRUN_ARGS", None)
    cmd = ["bash", str(ROOT / script), "--training.steps", "3"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    return lines[lines.index("torchtitan.launch") + 1 :]


@pytest.mark.smoke
@pytest.mark.parametrize("script", ["run_train.sh", "scripts/multinode_trainer.slurm"])
def test_launch_scripts_run_on_the_oldest_torchrun(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    argv = _launch_argv(script, tmp_path)
    options = [a.split("=")[0] for a in argv[: argv.index("-m")] if a.startswith("-")]
    print(f"{script} -> torchtitan.launch {' '.join(options)}")

    # torchtitan.launch as on torch 2.11: torchrun's parser and torch_compat's choice of 2.11.
    monkeypatch.setattr(torchrun, "get_args_parser", lambda: _recorded_parser(OLDEST))
    monkeypatch.setattr(torch_compat, "TORCHRUN_SHUTDOWN_TIMEOUT", False, raising=False)
    monkeypatch.setenv(launch.LAUNCH_DIR_ENV, "")
    seen: list[tuple[argparse.Namespace, int]] = []

    def run(args: argparse.Namespace) -> None:  # what the agent will wait for, on a signal
        from torch.distributed.elastic.multiprocessing.api import PContext

        seen.append((args, inspect.signature(PContext.close).parameters["timeout"].default))

    monkeypatch.setattr(torchrun, "run", run)
    try:
        rc = launch.main(argv)
    except SystemExit:  # argparse: "unrecognized arguments: ..."
        error = capsys.readouterr().err.strip().splitlines()[-1]
        pytest.fail(f"{script} on torch 2.11: {error}", pytrace=False)
    assert rc == 0
    unknown = set(options) - set(TORCHRUN_VALUED[OLDEST]) - set(SWITCHES)
    assert unknown <= set(launch.LAUNCH_OPTIONS), unknown
    (args, agent_timeout), *_ = seen
    assert (args.training_script, args.module) == ("torchtitan.train", True)
    assert args.training_script_args[-2:] == ["--training.steps", "3"]
    assert args.shutdown_timeout == agent_timeout == 120  # the scripts' default SHUTDOWN_TIMEOUT
    assert args.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@pytest.mark.smoke
def test_shutdown_timeout_option_is_validated(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as e:
        launch.parse_args(["--shutdown-timeout", "-5", "-m", "torchtitan.train"])
    assert e.value.code == 2
    assert "--shutdown-timeout -5: must be >= 0 seconds" in capsys.readouterr().err
    args = launch.parse_args(["--nproc_per_node", "2", "-m", "torchtitan.train", "--x", "1"])
    assert args.shutdown_timeout == 30 and args.training_script_args == ["--x", "1"]
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert launch.parse_args(["-m", "torchtitan.train"]).shutdown_timeout == 45
