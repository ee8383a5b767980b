#!/usr/bin/env bash
# Launch training through torchrun.
#
#   NGPU=4 LOG_RANK=0,3 CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh --training.steps 50
#
# NGPU         ranks on this machine (default: the number of GPUs, or 2 without a GPU or with
#              TORCHTITAN_DEVICE=cpu, which runs CPU ranks with gloo even where CUDA is visible)
# LOG_RANK     ranks whose output is shown (default 0): a comma list (0,3), and/or the words
#              `last` (the ranks holding the last pipeline stage) and `all`; e.g. LOG_RANK=0,last
# CONFIG_FILE  TOML config (default train_configs/debug_model.toml), or a comma list of them applied
#              in order (a.toml,overlay.toml; each may `extends` a base: docs/configs.md)
# extra args   config overrides, e.g. --parallelism.data_parallel_shard_degree 2 --metrics.log_freq 1;
#              --parallelism.auto lets the planner choose the layout for NGPU ranks (docs/planning.md)
#
# Preemption (with --checkpoint.enable): torchrun forwards SIGTERM and SIGUSR1 (SLURM's
# `--signal=USR1@120`) to every rank; the trainer saves a checkpoint at the next step boundary
# and exits 0 (and so does this script). Ranks still running SHUTDOWN_TIMEOUT seconds (default
# 120) after the signal are killed, so keep it above a checkpoint save (torchtitan.launch's
# --shutdown-timeout, on every torch of the window: torch 2.11's torchrun has no such option, so
# the launcher applies it there itself). A relaunch, or a torchrun restart after a crash (add
# --max-restarts N via TORCHRUN_ARGS), resumes from the newest complete checkpoint
# automatically; see docs/checkpoint.md.
#
# Which rank holds what: ranks are laid out on the mesh pp x dp_replicate x dp_shard x cp x tp
# (tp innermost), so rank r sits on pp rank r // (NGPU / pp degree). Every line a rank prints
# starts with its coordinates and, under pipeline parallel, its stage ids, e.g.
# "[rank 7 pp=1 dp_shard=1 tp=1 stages=1,3(last)]". Pipeline stage s is on pp rank s % pp, except
# for the V-shaped schedules (ZBVZeroBubble, DualPipeV) where pp rank r holds stages r and
# 2*pp-1-r, so the last stage, the one that computes the loss, is on pp rank 0 there and on pp
# rank pp-1 otherwise. Whatever the layout, every rank logs the real loss (the last stage shares
# it at each log step), so LOG_RANK=0 is enough; `last` resolves the layout for you.
#
# The first run creates .venv (scripts/setup_env.sh); set TORCHTITAN_PYTHON to use another python.
#
# Replica fault tolerance with torchft (--fault_tolerance.enable, docs/fault_tolerance.md): one
# run_train.sh per replica group, each with its --fault_tolerance.replica_id. They meet at torchft's
# lighthouse: TORCHFT_LIGHTHOUSE=http://host:29510 points at a running one (or pass
# --fault_tolerance.lighthouse); TORCHFT_LIGHTHOUSE=start starts one here first, in the background
# and outliving this job, on LIGHTHOUSE_PORT (default 29510) with LIGHTHOUSE_MIN_REPLICAS (default 1)
# and LIGHTHOUSE_ARGS, and prints where it listens (its log: LIGHTHOUSE_LOG, default ./lighthouse.log).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# CONFIG_FILE may be a comma list (base first, overlays after; docs/configs.md): each path is
# made absolute before the cd below.
IFS=, read -ra config_files <<<"${CONFIG_FILE:-train_configs/debug_model.toml}"
config=""
for f in "${config_files[@]}"; do
    [[ "$f" = /* || -f "$f" ]] && f="$(cd "$(dirname "$f")" && pwd)/$(basename "$f")"
    config="${config:+$config,}$f"
done
lighthouse_log="${LIGHTHOUSE_LOG:-$PWD/lighthouse.log}"  # TORCHFT_LIGHTHOUSE=start, below
cd "$root"

python="${TORCHTITAN_PYTHON:-$("$root/scripts/setup_env.sh")}"

if [[ -z "${NGPU:-}" ]]; then
    if [[ "${TORCHTITAN_DEVICE:-}" != cpu ]] && command -v nvidia-smi >/dev/null 2>&1 && n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" && [[ "$n" -gt 0 ]]; then
        NGPU="$n"
    else
        NGPU=2
    fi
fi
if [[ "${TORCHFT_LIGHTHOUSE:-}" == start ]]; then
    port="${LIGHTHOUSE_PORT:-29510}"
    lighthouse="$(dirname "$python")/torchft_lighthouse"
    [[ -x "$lighthouse" ]] || lighthouse=torchft_lighthouse
    # setsid: the lighthouse outlives this job (a replica group that dies must not take it along)
    setsid "$lighthouse" --bind "[::]:$port" --min_replicas "${LIGHTHOUSE_MIN_REPLICAS:-1}" \
        ${LIGHTHOUSE_ARGS:-} >"$lighthouse_log" 2>&1 </dev/null &
    export TORCHFT_LIGHTHOUSE="http://$(hostname):$port"
    for _ in $(seq 50); do
        grep -q "Lighthouse listening" "$lighthouse_log" 2>/dev/null && break
        sleep 0.2
    done
    echo "torchft lighthouse (pid $!) listening on $TORCHFT_LIGHTHOUSE; log $lighthouse_log" >&2
fi
# Validate before torchrun starts: a config error is one message and exit 2, no rank started;
# --launch adds the fit check against this machine's memory (docs/planning.md).
"$python" -m torchtitan.config --launch --world_size "$NGPU" --job.config_file "$config" "$@" >/dev/null ||
    exit $?
LOG_RANK="${LOG_RANK:-0}"
if [[ "$LOG_RANK" == *last* || "$LOG_RANK" == *all* ]]; then
    # The ranks holding the last stage depend on the schedule and degrees: ask the config.
    LOG_RANK="$("$python" -m torchtitan.log_ranks "$LOG_RANK" "$NGPU" \
        --job.config_file "$config" "$@")"
fi

# Without GPUs (or with TORCHTITAN_DEVICE=cpu) the ranks share the CPU cores: give each its share.
if [[ -z "${OMP_NUM_THREADS:-}" ]] && { [[ "${TORCHTITAN_DEVICE:-}" == cpu ]] ||
    ! "$python" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }; then
    cores="$(nproc)"
    export OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
fi
export HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-0}"
# A torchrun restart (--max-restarts) must not let the workers share the rendezvous store: a
# restarted worker can then read the previous attempt's peer addresses and hang or fail to
# connect (docs/checkpoint.md, "Restarts after a crash").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

# torchtitan.launch is torchrun with our exit codes: 0 done or gracefully preempted, 2 config or
# data error, 3 aborted by a guard, 4 a checkpoint write failed (full disk), 1 any other
# failure (docs/errors.md, "Exit codes"). Pass only options torch 2.11's torchrun accepts, or
# the launcher's own (tests/unit/test_launch_options.py checks).
exec "$python" -m torchtitan.launch \
    --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}" ${TORCHRUN_ARGS:-} \
    -m torchtitan.train --job.config_file "$config" "$@"
