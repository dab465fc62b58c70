#!/usr/bin/env bash
# One command for a time-limited GPU run: every stage writes its results into OUT_DIR and the run goes on when a
# stage fails or runs out of time (each has its own limit), so a lease never ends with nothing written.
#
#   eval/benchmarks/gpu_plan.sh OUT_DIR                    # the kernel stages: env check bench ncu sweep (~8 min on an H100)
#   eval/benchmarks/gpu_plan.sh OUT_DIR check bench        # chosen stages, in the order given
#   PLAN_SECONDS=540 MINIMIND_DIR=../minimind eval/benchmarks/gpu_plan.sh OUT_DIR env check bench train minimind real
#
# Stages (files written into OUT_DIR):
#   env      nvidia-smi, driver, python/torch/triton/liger versions, GPU properties      env.txt
#   check    kernels vs fp32 references (bf16 with the >2^31-element case, fp32), the model
#            with norm_impl=triton vs eager and under torch.compile(fullgraph=True); its
#            parts run side by side (correctness only: nothing in them is timed)          check_*.md
#   bench    ours vs eager, F.rms_norm, torch.compile, Liger: wall-clock and kernel-only   bench_*.md/.json
#   benchw   the same with an fp32 weight (the model's own case; methods that take one)   bench_bf16_fp32weight.*
#   host     where the wall-clock time of each method's fwd+bwd goes (torch.profiler, host side) host.txt
#   ncu      Nsight Compute on our forward and backward at N = 768, 4096, 16384             ncu_N.txt
#   sweep    our kernels per launch configuration (warps, programs per SM, stages)        sweep.md/.json
#   train    the training-step benchmark (tokens/s, MFU; RMSNorm triton/eager, LayerNorm)  train.md
#   minimind our trainer vs MiniMind's own trainer/train_pretrain.py (a checkout of its
#            public repository in MINIMIND_DIR), same GPU, shape and text; real tokens/s  minimind.md/.json, minimind/
#   real     pretrain minimind-26m for REAL_STEPS steps, SFT, then chat answers with tools real.md
# Stage limits in seconds can be changed with LIMIT_<STAGE>=... (e.g. LIMIT_BENCH=300). PLAN_SECONDS bounds the
# whole plan: each stage's limit shrinks to what is left, and a stage with under 20 s left is skipped. BENCH_ARGS,
# TRAIN_ARGS and MINIMIND_ARGS add flags to those stages' commands (e.g. BENCH_ARGS=--no-residual).
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

side_by_side() {  # side_by_side LIMIT "NAME FILE command..." ...: parts at once (never timed ones), then their lines
    local limit=$1 part t0=$(date +%s)
    shift
    local names=() files=() pids=()
    for part in "$@"; do
        read -r -a words <<<"$part"
        names+=("${words[0]}")
        files+=("${words[1]}")
        (timeout -k 10 "$limit" "${words[@]:2}" >"${words[1]}" 2>&1; echo $? >"${words[1]}.rc") &
        pids+=($!)
    done
    wait "${pids[@]}"
    for i in "${!names[@]}"; do
        local rc
        rc=$(cat "${files[$i]}.rc" 2>/dev/null || echo "?")
        rm -f "${files[$i]}.rc"
        summary+=("${names[$i]}: exit $rc after $(( $(date +%s) - t0 )) s (side by side) -> $(basename "${files[$i]}")")
        echo "[$(( $(date +%s) - started )) s] ${names[$i]}: exit $rc"
        tail -n 3 "${files[$i]}"
    done
}

limit() {  # limit STAGE DEFAULT: the stage's time limit, cut to what PLAN_SECONDS leaves (0: skip the stage)
    local var="LIMIT_${1^^}" own
    own=${!var:-$2}
    if [ -n "${PLAN_SECONDS:-}" ]; then
        local left=$(( started + PLAN_SECONDS - $(date +%s) ))
        [ "$left" -lt 20 ] && left=0
        [ "$left" -lt "$own" ] && own=$left
    fi
    echo "$own"
}

for stage in "${stages[@]}"; do
    if [ "$(limit "$stage" 1)" = 0 ]; then
        summary+=("$stage: skipped, under 20 s of PLAN_SECONDS left")
        echo "$stage: skipped, under 20 s of PLAN_SECONDS left"
        continue
    fi
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
        lim=$(limit check 240)
        small="96 512 768 1024" large="2048 4096 8192 16384"
        side_by_side "$lim" \
            "check_bf16_small $out/check_bf16_small.md $PY eval/benchmarks/bench_norm.py --check --dtype bf16 --no-big --n $small" \
            "check_bf16_large $out/check_bf16_large.md $PY eval/benchmarks/bench_norm.py --check --dtype bf16 --no-big --n $large" \
            "check_bf16_big $out/check_bf16_big.md $PY eval/benchmarks/bench_norm.py --check --dtype bf16 --n 4096 --m 1000" \
            "check_fp32_small $out/check_fp32_small.md $PY eval/benchmarks/bench_norm.py --check --dtype fp32 --no-big --n $small" \
            "check_fp32_large $out/check_fp32_large.md $PY eval/benchmarks/bench_norm.py --check --dtype fp32 --no-big --n $large" \
            "check_model $out/check_model.md $PY eval/benchmarks/bench_norm.py --check_model"
        ;;
    bench)
        run bench "$(limit bench 300)" "$out/bench_bf16.md" $PY eval/benchmarks/bench_norm.py --out "$out/bench_bf16.json" \
            ${BENCH_ARGS:-}
        ;;
    benchw)
        # The model's own case: bf16 activations with fp32 master weights (methods that take such a weight).
        run benchw "$(limit benchw 300)" "$out/bench_bf16_fp32weight.md" $PY eval/benchmarks/bench_norm.py \
            --weight_dtype fp32 --methods ours eager compile --out "$out/bench_bf16_fp32weight.json"
        ;;
    host)
        run host "$(limit host 120)" "$out/host.txt" $PY eval/benchmarks/bench_norm.py --profile_host 512
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
            --seq_len 512 --steps 10 --warmup 3 ${TRAIN_ARGS:-}
        ;;
    minimind)
        if [ -z "${MINIMIND_DIR:-}" ]; then
            summary+=("minimind: skipped, MINIMIND_DIR (a checkout of MiniMind's repository) is not set")
            echo "minimind: skipped, MINIMIND_DIR is not set" >&2
            continue
        fi
        run minimind "$(limit minimind 240)" "$out/minimind.md" $PY eval/benchmarks/bench_vs_minimind.py \
            --minimind_dir "$MINIMIND_DIR" --log_dir "$out/minimind" --json "$out/minimind.json" ${MINIMIND_ARGS:-}
        ;;
    real)
        steps=${REAL_STEPS:-3000}
        run real "$(limit real 540)" "$out/real.md" bash -c "
            $PY trainer/train_pretrain.py --preset minimind-26m --batch_size 32 --max_seq_len 512 --max_steps $steps \
                --eval_interval 500 --save_interval 100000 --overwrite --out_dir out/gpu_pretrain &&
            $PY trainer/train_full_sft.py --from_weight out/gpu_pretrain --batch_size 32 \
                --max_seq_len 512 --max_steps $(( steps / 3 )) --eval_interval 500 --save_interval 100000 \
                --overwrite --out_dir out/gpu_sft &&
            for q in 'Who was Josip Broz Tito?' 'What is 66 times 81?' 'How many kilometers is 26 miles?' \
                     'What is the capital of France?' 'Hi! How are you?'; do
                echo \"Q: \$q\"; $PY eval/chat.py --model_path out/gpu_sft --prompt \"\$q\" --temperature 0 \
                    --max_new_tokens 80; done"
        ;;
    *)
        echo "unknown stage '$stage' (env check bench benchw host ncu sweep train minimind real)" >&2
        ;;
    esac
done
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
