#!/usr/bin/env bash
# One command for a time-limited GPU run: every stage writes its results into OUT_DIR and the run goes on when a
# stage fails or runs out of time (each has its own limit), so a lease never ends with nothing written.
#
#   eval/benchmarks/gpu_plan.sh OUT_DIR                    # the kernel stages: env check bench ncu sweep (~8 min on an H100)
#   eval/benchmarks/gpu_plan.sh OUT_DIR check bench        # chosen stages, in the order given
#   eval/benchmarks/gpu_plan.sh OUT_DIR train real         # the trainer on the GPU (see the stages below)
#
# Stages (files written into OUT_DIR):
#   env     nvidia-smi, driver, python/torch/triton/liger versions, GPU properties       env.txt
#   check   kernels vs fp32 references (bf16 with the >2^31-element case, fp32), the model
#           with norm_impl=triton vs eager and under torch.compile(fullgraph=True)         check_*.md
#   bench   ours vs eager, F.rms_norm, torch.compile, Liger: wall-clock and kernel-only    bench_*.md/.json
#   ncu     Nsight Compute on our forward and backward at N = 768, 4096, 16384             ncu_N.txt
#   sweep   our kernels per launch configuration (warps, programs per SM, stages)         sweep.md/.json
#   train   the training-step benchmark (tokens/s, MFU; RMSNorm triton/eager, LayerNorm)  train.md
#   real    pretrain minimind-26m for REAL_STEPS steps, SFT, then chat answers             real.md
# Stage limits in seconds can be changed with LIMIT_<STAGE>=... (e.g. LIMIT_BENCH=300).
set -u
out=${1:?usage: eval/benchmarks/gpu_plan.sh OUT_DIR [STAGE ...]}
shift
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env check bench ncu sweep)
cd "$(dirname "$0")/../.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
started=$(date +%s)
summary=()

run() {  # run NAME LIMIT_SECONDS FILE command...: stdout+stderr into FILE, never stops the plan
    local name=$1 limit=$2 file=$3
    shift 3
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$file" 2>&1
    local rc=$?
    summary+=("$name: exit $rc after $(( $(date +%s) - t0 )) s -> $(basename "$file")")
    echo "[$(( $(date +%s) - started )) s] $name: exit $rc"
    tail -n 3 "$file"
}

limit() {  # limit STAGE DEFAULT: the stage's time limit
    local var="LIMIT_${1^^}"
    echo "${!var:-$2}"
}

for stage in "${stages[@]}"; do
    case $stage in
    env)
        run env "$(limit env 60)" "$out/env.txt" bash -c "nvidia-smi; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv; lscpu | grep -E 'Model name|^CPU\\(s\\)'; $PY - <<'EOF'
import platform, torch, triton
print('python', platform.python_version(), '| torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__)
print(torch.cuda.get_device_properties(0))
try:
    import importlib.metadata as md; print('liger-kernel', md.version('liger-kernel'))
except Exception as err:
    print('liger-kernel: not installed', err)
EOF"
        ;;
    check)
        run check_bf16 "$(limit check 240)" "$out/check_bf16.md" $PY eval/benchmarks/bench_norm.py --check --dtype bf16
        run check_fp32 "$(limit check 240)" "$out/check_fp32.md" $PY eval/benchmarks/bench_norm.py --check --dtype fp32 --no-big
        run check_model "$(limit check 240)" "$out/check_model.md" $PY eval/benchmarks/bench_norm.py --check_model
        ;;
    bench)
        run bench "$(limit bench 300)" "$out/bench_bf16.md" $PY eval/benchmarks/bench_norm.py --out "$out/bench_bf16.json"
        # The model's own case: bf16 activations with fp32 master weights (methods that take such a weight).
        run bench_fp32w "$(limit bench 300)" "$out/bench_bf16_fp32weight.md" $PY eval/benchmarks/bench_norm.py \
            --weight_dtype fp32 --methods ours eager compile --out "$out/bench_bf16_fp32weight.json"
        ;;
    ncu)
        for n in 768 4096 16384; do
            run "ncu_$n" "$(limit ncu 120)" "$out/ncu_$n.txt" ncu --target-processes all --kernel-name regex:_rms_norm \
                --set detailed --section WarpStateStats --section SchedulerStats \
                $PY eval/benchmarks/bench_norm.py --profile_once "$n"
        done
        ;;
    sweep)
        run sweep "$(limit sweep 300)" "$out/sweep.md" $PY eval/benchmarks/bench_norm.py --sweep --out "$out/sweep.json"
        ;;
    train)
        run train "$(limit train 300)" "$out/train.md" $PY eval/benchmarks/bench_train.py --dtypes bfloat16 --batch_size 32 \
            --seq_len 512 --steps 10 --warmup 3
        ;;
    real)
        steps=${REAL_STEPS:-3000}
        run real "$(limit real 540)" "$out/real.md" bash -c "
            $PY trainer/train_pretrain.py --preset minimind-26m --batch_size 32 --max_seq_len 512 --max_steps $steps \
                --eval_interval 1000 --save_interval 1000 --out_dir out/gpu_pretrain &&
            $PY trainer/train_full_sft.py --preset minimind-26m --from_weight out/gpu_pretrain --batch_size 32 \
                --max_seq_len 512 --max_steps $(( steps / 3 )) --out_dir out/gpu_sft &&
            for q in 'What is the capital of France?' 'Tell me about the moon.' 'How are you today?'; do
                echo \"Q: \$q\"; $PY eval/chat.py --model_path out/gpu_sft --prompt \"\$q\" --max_new_tokens 80; done"
        ;;
    *)
        echo "unknown stage '$stage' (env check bench ncu sweep train real)" >&2
        ;;
    esac
done
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
