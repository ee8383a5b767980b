#!/usr/bin/env bash
# One-command self-check of a (new) GPU machine, offline, with the packages it already has:
#
#   scripts/gpu_check.sh           environment, the gpu-marked tests, the throughput ladder of the
#                                  1B shape at seq 8192 (eager, compile, compile + float8
#                                  tensorwise / rowwise, FlexAttention document masking), the
#                                  MoE families' debug flavors (Qwen3-MoE, DeepSeek-V3, GPT-OSS,
#                                  Qwen3.5; eager and compile, bf16 autocast), the published MoE
#                                  shapes at 4 blocks (Qwen3-30B-A3B/235B-A22B, DeepSeek-V2-Lite,
#                                  DeepSeek-V3's expert width, GPT-OSS 20b/120b; compiled bf16 and
#                                  float8 experts, after their preflight), the experts' grouped
#                                  GEMM against their loop, Qwen3.5's delta rule (fla kernel vs
#                                  the PyTorch chunked form), then train 30 steps with async pinned
#                                  checkpoints, resume to step 40 and generate from the checkpoint
#   scripts/gpu_check.sh --cpu     the same sequence, small, on CPU (debug model, `async` saves;
#                                  the published MoE shapes through the preflight only): what a
#                                  machine without a GPU (and CI) can check of this script
#
# Ends with one summary table (also in $OUT/summary.txt) and exits 1 if any step failed.
# OUT (default outputs/gpu_check) holds each step's log; TORCHTITAN_PYTHON picks the python
# (default python3, e.g. the GPU image's own torch); LADDER_STEPS sets the timed steps (10);
# STEP_TIMEOUT (2400 s) bounds each step, so a hang fails its row instead of the whole check.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mode=gpu
[[ "${1:-}" == "--cpu" ]] && mode=cpu
python="${TORCHTITAN_PYTHON:-python3}"
out="${OUT:-$root/outputs/gpu_check}"
rm -rf "$out" && mkdir -p "$out"
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline WANDB_SILENT=true
export PYTHONUNBUFFERED=1 TORCHTITAN_DEVICE=$([[ $mode == cpu ]] && echo cpu || echo cuda)
debug=(--job.config_file train_configs/debug_model.toml --metrics.no-enable_tensorboard)

if [[ $mode == gpu ]]; then
    ladder_only="eager,compile,compile+float8_tensorwise,compile+float8_rowwise,compile+block_causal"
    ladder_args=(--warmup 3 --steps "${LADDER_STEPS:-10}" -- "${debug[@]}" --model.flavor 1B
        --training.seq_len 8192 --training.local_batch_size 1
        --training.mixed_precision_param bfloat16)
    families_only="qwen3_moe,compile+qwen3_moe,deepseek_v3,compile+deepseek_v3,gpt_oss,compile+gpt_oss"
    families_only+=",qwen3_5,compile+qwen3_5,qwen3_5_moe"
    families_args=(--warmup 3 --steps "${LADDER_STEPS:-10}" -- "${debug[@]}" --training.seq_len 4096
        --training.local_batch_size 2 --training.mixed_precision_param bfloat16)
    shapes_only=""
    for s in qwen3_30b_a3b qwen3_235b_a22b dsv2_lite_16b dsv3_671b_width gpt_oss_20b gpt_oss_120b; do
        shapes_only+=",compile+$s,compile+float8_experts+$s"
    done
    shapes_only="qwen3_30b_a3b,dsv2_lite_16b$shapes_only"
    train_args=("${debug[@]}" --checkpoint.enable --checkpoint.interval 5
        --checkpoint.async_mode async_with_pinned_mem --metrics.log_freq 10)
    steps=30 more=40 new_tokens=32
else
    ladder_only="eager"
    ladder_args=(--warmup 1 --steps 2 --peak-budget 0.3 -- "${debug[@]}" --training.seq_len 64
        --training.local_batch_size 2 --training.mixed_precision_param float32)
    families_only="qwen3_moe,deepseek_v3,gpt_oss,qwen3_5,qwen3_5_moe"
    families_args=("${ladder_args[@]}")
    shapes_only=""
    train_args=("${debug[@]}" --training.seq_len 64 --training.local_batch_size 2
        --training.mixed_precision_param float32 --checkpoint.enable --checkpoint.interval 2
        --checkpoint.async_mode async --metrics.log_freq 2)
    steps=8 more=10 new_tokens=8
fi

rows=()
failed=0
record() { # name status seconds detail
    rows+=("$1|$2|$3|$4")
    [[ $2 == PASS ]] || failed=1
    printf '[gpu_check] %-28s %s (%s s) %s\n' "$1" "$2" "$3" "$4" >&2
}
timed() { # log_file command...: runs it (at most STEP_TIMEOUT seconds), sets rc and secs
    local t0=$SECONDS
    timeout "${STEP_TIMEOUT:-2400}" "${@:2}" >"$1" 2>&1
    rc=$?
    secs=$((SECONDS - t0))
}
jq_py() { "$python" -c "import json, sys; $1" "${@:2}"; }

# 1. environment
timed "$out/environment.log" "$python" - "$mode" <<'EOF'
import importlib.metadata as md, shutil, subprocess, sys
import torch
from torchtitan.tools.torch_compat import MAX_TORCH, MIN_TORCH, TORCH_VERSION
def version(p):
    try:
        return md.version(p)
    except md.PackageNotFoundError:
        return "not installed"
gpu = "none"
if torch.cuda.is_available():
    gpu = f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
driver = "n/a"
if shutil.which("nvidia-smi"):
    q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    driver = subprocess.run(q, capture_output=True, text=True).stdout.split("\n")[0] or "n/a"
window = MIN_TORCH <= TORCH_VERSION <= MAX_TORCH
print(f"gpu={gpu} driver={driver} torch={torch.__version__} cuda={torch.version.cuda} "
      f"torchao={version('torchao')} python={sys.version.split()[0]} window_ok={window}")
sys.exit(0 if window and (sys.argv[1] == "cpu" or torch.cuda.is_available()) else 1)
EOF
detail="$(tail -n 1 "$out/environment.log")"
record environment "$([[ $rc == 0 ]] && echo PASS || echo FAIL)" "$secs" "$detail"
cat "$out/environment.log" >&2

# 2. the gpu-marked tests (skipped, with the reason, on CPU)
timed "$out/pytest_gpu.log" env -u TORCHTITAN_DEVICE "$python" -m pytest -m gpu -q -p no:cacheprovider tests
summary="$(grep -E '(passed|failed|skipped|error)' "$out/pytest_gpu.log" | tail -n 1 | tr -d '=')"
ok=$([[ $rc == 0 ]] && echo PASS || echo FAIL)
[[ $mode == gpu && $summary != *passed* ]] && ok=FAIL # on a GPU, all skipped is a failure
record "pytest -m gpu" "$ok" "$secs" "${summary# }"

# 3. throughput ladders: the 1B shape, then the MoE families' debug flavors
ladder() { # log_file only_labels throughput.py arguments...
    timed "$1" "$python" benchmarks/throughput.py --ladder --only "$2" --threads 0 "${@:3}"
    local ladder_rc=$rc ladder_secs=$secs label status detail
    while IFS='|' read -r label status detail; do
        record "ladder $label" "$status" "$ladder_secs" "$detail"
    done < <(jq_py '
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    label = r["label"]
    if "error" in r:
        err = (r["stderr_tail"].strip().splitlines() or [""])[-1][:90]
        print(f"{label}|FAIL|{r['"'"'error'"'"']}: {err}")
        continue
    tps, mem, sheet = r["tokens_per_s_per_device"], r["peak_memory_gib"], r["mfu_datasheet_pct"]
    mfu = f", MFU {sheet}% of datasheet" if sheet is not None else ""
    print(f"{label}|PASS|{tps:,.0f} tok/s{mfu}, MFU {r['"'"'mfu_measured_pct'"'"']}% of measured peak, peak mem {mem} GiB")
' "$1")
    [[ $(grep -c '^{' "$1") -ge 1 ]] || record ladder FAIL "$ladder_secs" "no JSON line (see $1)"
    [[ $ladder_rc == 0 ]] || record "ladder (exit code)" FAIL "$ladder_secs" "exit $ladder_rc"
}
ladder "$out/ladder.jsonl" "$ladder_only" "${ladder_args[@]}"
ladder "$out/families.jsonl" "$families_only" "${families_args[@]}"

# 3a. the published MoE shapes at 4 blocks (benchmarks/throughput.py, docs/performance.md): every
# row's config through the preflight (both modes), then on a GPU bf16 eager / compiled and
# compiled with float8 experts, seq 4096 x 2
all_shapes="$(jq_py 'import runpy; m = runpy.run_path("benchmarks/throughput.py", run_name="x"); print(",".join(l for l, a in m["LADDER"] if "--model.n_layers" in a))')"
timed "$out/shapes_preflight.jsonl" "$python" benchmarks/throughput.py --ladder --preflight \
    --only "$all_shapes" -- "${debug[@]}" --training.seq_len 4096 --training.local_batch_size 2
detail="$(jq_py '
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
bad = [r["label"] for r in rows if "error" in r]
ok = rows and not bad
print(("PASS" if ok else "FAIL") + f"|{len(rows) - len(bad)} of {len(rows)} rows valid" + (f", failed: {bad}" if bad else ""))
' "$out/shapes_preflight.jsonl" 2>/dev/null)"
[[ $rc == 0 && -n $detail ]] || detail="FAIL|exit $rc (see shapes_preflight.jsonl)"
record "moe shapes preflight" "${detail%%|*}" "$secs" "${detail#*|}"
[[ -n $shapes_only ]] && ladder "$out/shapes.jsonl" "$shapes_only" "${families_args[@]}"

# 3b. the routed experts' grouped GEMM against the per-expert loop (docs/moe.md)
timed "$out/grouped_gemm.log" "$python" benchmarks/moe_grouped_gemm.py
detail="$(jq_py '
r = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
g, lp = r.get("grouped"), r["loop"]
ok = g is not None and r["max_abs_diff_out"] <= 1e-2 and r["rel_diff_w1_grad"] <= 1e-2
print(("PASS" if ok else "FAIL") + "|" + (f"grouped {g['"'"'ms'"'"']} ms ({g['"'"'tflops'"'"']} TFLOP/s) vs loop {lp['"'"'ms'"'"']} ms, x{r['"'"'speedup'"'"']}, {r['"'"'dtype'"'"']}" if g else "grouped_mm unsupported here"))
' "$out/grouped_gemm.log" 2>/dev/null)"
[[ $rc == 0 && -n $detail ]] || detail="FAIL|exit $rc (see grouped_gemm.log)"
record "grouped GEMM vs loop" "${detail%%|*}" "$secs" "${detail#*|}"

# 3c. Qwen3.5's delta rule: flash-linear-attention's kernel against the PyTorch chunked form
# (docs/qwen3_5.md; on CPU, or without fla, the chunked form alone)
timed "$out/delta_rule.log" "$python" benchmarks/delta_rule.py $([[ $mode == cpu ]] && echo --small)
detail="$(jq_py '
r = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
fla = r.get("fla_ms")
ok = fla is None or r["max_rel_diff"] <= 1e-2
tail = f", fla {fla} ms (x{r['"'"'speedup'"'"']}), max rel diff {r['"'"'max_rel_diff'"'"']:.1e}" if fla else ", fla not installed"
print(("PASS" if ok else "FAIL") + f"|chunked {r['"'"'chunked_ms'"'"']} ms fwd+bwd" + tail)
' "$out/delta_rule.log" 2>/dev/null)"
[[ $rc == 0 && -n $detail ]] || detail="FAIL|exit $rc (see delta_rule.log)"
record "delta rule fla vs chunked" "${detail%%|*}" "$secs" "${detail#*|}"

# 4. end to end: train with async checkpoints, resume, generate
dump="$out/e2e"
timed "$out/train.log" "$python" -m torchtitan.train "${train_args[@]}" --job.dump_folder "$dump" \
    --training.steps "$steps"
saves=$(grep -c "background save of step .* committed" "$out/train.log")
loss="$(jq_py 'print([json.loads(l) for l in open(sys.argv[1])][-1]["loss"])' \
    "$dump/metrics/rank_0.jsonl" 2>/dev/null)"
ok=$([[ $rc == 0 && $saves -ge 3 ]] && echo PASS || echo FAIL)
record "train $steps steps" "$ok" "$secs" "exit $rc, $saves background saves committed, loss ${loss:-?}"

timed "$out/resume.log" "$python" -m torchtitan.train "${train_args[@]}" --job.dump_folder "$dump" \
    --training.steps "$more"
ok=$([[ $rc == 0 ]] && grep -q "resuming after step $steps" "$out/resume.log" && echo PASS || echo FAIL)
last="$(jq_py 'print([json.loads(l) for l in open(sys.argv[1])][-1]["step"])' \
    "$dump/metrics/rank_0.jsonl" 2>/dev/null)"
record "resume to $more" "$ok" "$secs" "exit $rc, resumed after step $steps, last step ${last:-?}"

timed "$out/generate.log" "$python" scripts/generate.py "$dump/checkpoint" --prompt "Once upon a time" \
    --max_new_tokens "$new_tokens" --json
made="$(jq_py '
r = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
print(len(r.get("new_ids", r.get("ids", []))))' "$out/generate.log" 2>/dev/null)"
ok=$([[ $rc == 0 && -n $made ]] && echo PASS || echo FAIL)
record generate "$ok" "$secs" "exit $rc, ${made:-?} token ids"

# Summary
{
    printf '\n%-30s %-6s %7s  %s\n' "check ($mode)" status seconds detail
    printf '%s\n' "--------------------------------------------------------------------------------"
    for row in "${rows[@]}"; do
        IFS='|' read -r name status secs detail <<<"$row"
        printf '%-30s %-6s %7s  %s\n' "$name" "$status" "$secs" "$detail"
    done
    printf '%s\n' "--------------------------------------------------------------------------------"
    printf 'result: %s (logs in %s)\n' "$([[ $failed == 0 ]] && echo PASS || echo FAIL)" "$out"
} | tee "$out/summary.txt"
exit "$failed"
