#!/usr/bin/env bash
# The prepared GPU run: every GPU check of docs/gpu.md in one command, from the repo root, on a
# machine with one NVIDIA GPU, in under 8 minutes (--budget, default 470 s).
#
# With the device tool, after `bash scripts/gpu_wheels.sh` here (it fills the git-ignored .whl/):
#   run(command="bash scripts/gpu_suite.sh", carry=[".whl"], timeout_s=540)
#
#   bash scripts/gpu_suite.sh [--dry-run] [--budget SECONDS] [--only PART[,PART...]]
#                             [--force-timeout PART]
#
# Parts, in this order, each under its own `timeout` (and never past the budget, keeping the
# minimum each later part needs):
#   install         the .whl/ wheels, if any, into /tmp/site; torch, CUDA, driver, GPU and package versions
#   devices         `shardpool devices --json`: compute capability, bf16, the NF4 probe
#   generate        scripts/bench_generate.py --device cuda:0 --pairs 2: one stage against peft's
#                   `generate`, two stages on the GPU with 8 requests in flight, time to first token
#   cuda_tests      the tests that skip without CUDA (found by scripts/gpu_suite_tools.py)
#   gpu_check       scripts/gpu_check.py (CUDA stages against the CPU fp32 result, memory ratios)
#   s2_one_gpu, memory_vs_plan, fp16_loss_scaling   read off gpu_check's report (no runs of their own)
#   torch_nf4_vs_bnb  scripts/bench_paired.py --b torch-nf4: one stage on bitsandbytes' kernels
#                   against one on the PyTorch NF4 path (its exactness is in cuda_tests)
#   stage_vs_peft   scripts/bench_stage_vs_peft.py: one stage against a plain peft loop, 8B layers;
#                   about 3 minutes, so only when named: --only stage_vs_peft (or with others)
#
# It writes to $OUT (default ./gpu-suite-out), at most 8 files: suite.json (every part with its
# status, rewritten after each part, so a run stopped early keeps what finished), suite.md (the
# same as a table), suite.log (all output), gpu-check.json, bench.json, nf4-bench.json and
# generate.json (the parts' own reports).
# Exit status: 0 when every part that ran is ok, skipped or without data; 1 when one failed or
# timed out; 2 for a bad argument.
#
# --dry-run checks the plumbing on a machine without a GPU (the test suite runs it): no install,
# gpu_check skips itself, the CUDA tests skip, the benchmark prints its workload only.
# --force-timeout PART runs PART with a 1 s limit after a 5 s sleep: the timeout path, for the test.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$REPO/gpu-suite-out}
DRY_RUN=0
BUDGET=470
ONLY=""
FORCE_TIMEOUT=""

# part: the most seconds it may take, and the least worth starting it with (kept for it while
# earlier parts run). gpu_check's own --budget is its limit less GPU_CHECK_MARGIN.
# On an H200 a gpu_check run takes about 65 s and its CPU reference about 70 s; stage_vs_peft
# about 180 s.
PARTS=(install devices generate cuda_tests gpu_check torch_nf4_vs_bnb stage_vs_peft)
DEFAULT_PARTS="install devices generate cuda_tests gpu_check torch_nf4_vs_bnb"
declare -A LIMIT=([install]=90 [devices]=60 [generate]=180 [cuda_tests]=100 [gpu_check]=300 [torch_nf4_vs_bnb]=150 [stage_vs_peft]=220)
declare -A NEEDS=([install]=30 [devices]=20 [generate]=100 [cuda_tests]=60 [gpu_check]=140 [torch_nf4_vs_bnb]=100 [stage_vs_peft]=180)
GPU_CHECK_MARGIN=20
# gpu_check's runs, those docs/gpu.md has no result for first, without cuda+cuda/bf16 and
# cuda+cpu/bf16 (bf16 is covered by cuda/bf16).
GPU_CHECK_RUNS=("cuda+cpu/fp32" "cuda/bf16" "cuda/fp16" "cuda+cuda/fp32 re-shard" "cuda+cpu/fp32 re-shard"
    "cuda+cuda/fp16" "cuda+cpu/fp16" "cuda/fp32" "cuda+cuda/fp32")
ALL_PARTS="install devices generate cuda_tests gpu_check s2_one_gpu memory_vs_plan fp16_loss_scaling torch_nf4_vs_bnb stage_vs_peft"

usage() {
    echo "gpu_suite: $1; usage: bash scripts/gpu_suite.sh [--dry-run] [--budget SECONDS] [--only PART[,PART...]] [--force-timeout PART] (parts: $ALL_PARTS)" >&2
    exit 2
}
known_part() { [[ " $ALL_PARTS " == *" $1 "* ]]; }

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --budget)
            [[ "${2:-}" =~ ^[0-9]+$ ]] || usage "--budget needs whole seconds"
            BUDGET=$2
            shift
            ;;
        --only)
            [ -n "${2:-}" ] || usage "--only needs part names"
            ONLY=${2//,/ }
            shift
            ;;
        --force-timeout)
            known_part "${2:-}" || usage "--force-timeout needs a part name"
            FORCE_TIMEOUT=$2
            shift
            ;;
        -h | --help)
            sed -n '2,30p' "$0"
            exit 0
            ;;
        *) usage "unknown argument $1" ;;
    esac
    shift
done
for part in $ONLY; do known_part "$part" || usage "unknown part $part"; done

mkdir -p "$OUT" || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-suite.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
SITE=/tmp/site
export REPO OUT WORK PY DRY_RUN SITE
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$SITE:$REPO:$REPO/dev${PYTHONPATH:+:$PYTHONPATH}" # dev/: the benchmark library (shardpool_dev)
TOOLS=("$PY" "$REPO/scripts/gpu_suite_tools.py")
dry_flag=()
if [ "$DRY_RUN" = 1 ]; then
    dry_flag=(--dry-run)
    export CUDA_VISIBLE_DEVICES="" # the plumbing alone, the same on a machine with a GPU
fi
"${TOOLS[@]}" init --out "$OUT" --budget "$BUDGET" "${dry_flag[@]}" || exit 2
: >"$OUT/suite.log"

# ----- the parts (each runs in its own bash under `timeout`) --------------------------------------

part_install() {
    if [ "$DRY_RUN" = 1 ]; then
        "$PY" scripts/gpu_suite_tools.py size-check --wheels .whl || return
    elif ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || return
    else
        echo "gpu_suite: no wheels in .whl/: using the installed packages (scripts/gpu_wheels.sh makes them)"
    fi
    "$PY" scripts/gpu_suite_tools.py versions
}

part_devices() {
    "$PY" -m shardpool devices --json
}

part_gpu_check() {
    local budget=$((PART_LIMIT - GPU_CHECK_MARGIN)) runs
    [ "$budget" -ge 30 ] || budget=30
    mapfile -t runs <"$WORK/gpu-check-runs"
    "$PY" scripts/gpu_check.py --json "$OUT/gpu-check.json" --budget "$budget" --only "${runs[@]}"
}

part_cuda_tests() {
    local ids
    mapfile -t ids < <("$PY" scripts/gpu_suite_tools.py cuda-tests)
    [ "${#ids[@]}" -gt 0 ] || { echo "gpu_suite: no test skips without CUDA"; return 1; }
    printf 'gpu_suite: %s\n' "${ids[@]}"
    "$PY" -m pytest -n 0 -q -p no:cacheprovider -m "" --junitxml "$WORK/cuda-tests.xml" "${ids[@]}" # every tier
}

part_stage_vs_peft() {
    if [ "$DRY_RUN" = 1 ]; then
        "$PY" scripts/bench_stage_vs_peft.py --plan-only
    else
        "$PY" scripts/bench_stage_vs_peft.py --json "$OUT/bench.json"
    fi
}
part_torch_nf4_vs_bnb() {
    if [ "$DRY_RUN" = 1 ]; then
        "$PY" scripts/bench_paired.py --help >/dev/null || return
        echo "gpu_suite: dry run: bench_paired.py --b torch-nf4 not started"
    else
        "$PY" scripts/bench_paired.py --device cuda --size gpu --b torch-nf4 --pairs 1 --max-wait-idle 0 \
            >"$WORK/nf4-bench.json" || return
        cp "$WORK/nf4-bench.json" "$OUT/nf4-bench.json"
    fi
}
part_generate() {
    if [ "$DRY_RUN" = 1 ]; then
        "$PY" scripts/bench_generate.py --help >/dev/null || return
        echo "gpu_suite: dry run: bench_generate.py --device cuda:0 not started"
    else
        "$PY" scripts/bench_generate.py --device cuda:0 --pairs 2 --max-wait-idle 0 >"$WORK/generate.json" || return
        cp "$WORK/generate.json" "$OUT/generate.json"
    fi
}
export -f part_install part_devices part_generate part_gpu_check part_cuda_tests part_stage_vs_peft part_torch_nf4_vs_bnb
export GPU_CHECK_MARGIN
printf '%s\n' "${GPU_CHECK_RUNS[@]}" >"$WORK/gpu-check-runs" # bash cannot export an array

# ----- running them ---------------------------------------------------------------------------

chosen() { [[ " ${ONLY:-$DEFAULT_PARTS} " == *" $1 "* ]]; }
not_chosen_reason() { if [ -n "$ONLY" ]; then echo "not chosen (--only)"; else echo "not in the default run (--only $1)"; fi; }

# The seconds later parts keep for themselves while part number $1 runs.
needs_after() {
    local total=0 index
    for ((index = $1 + 1; index < ${#PARTS[@]}; index++)); do
        chosen "${PARTS[$index]}" && total=$((total + NEEDS[${PARTS[$index]}]))
    done
    echo "$total"
}

for index in "${!PARTS[@]}"; do
    name=${PARTS[$index]}
    if ! chosen "$name"; then
        "${TOOLS[@]}" skip --out "$OUT" --part "$name" --reason "$(not_chosen_reason "$name")"
        continue
    fi
    left=$((BUDGET - SECONDS))
    limit=$((left - $(needs_after "$index")))
    [ "$limit" -le "${LIMIT[$name]}" ] || limit=${LIMIT[$name]}
    if [ "$limit" -lt "${NEEDS[$name]}" ] && [ "$name" != "$FORCE_TIMEOUT" ]; then
        "${TOOLS[@]}" skip --out "$OUT" --part "$name" --reason "budget: ${left} s left, it needs ${NEEDS[$name]} s"
        echo "gpu_suite: $name: skipped (budget)"
        continue
    fi
    command="part_$name"
    if [ "$name" = "$FORCE_TIMEOUT" ]; then
        limit=1
        command="sleep 5; $command"
    fi
    echo "=== gpu_suite: $name (limit ${limit} s) ===" | tee -a "$OUT/suite.log"
    begun=$SECONDS
    PART_LIMIT=$limit timeout --kill-after=10 "$limit" bash -c "$command" 2>&1 |
        tee "$WORK/$name.log" >>"$OUT/suite.log"
    rc=${PIPESTATUS[0]}
    status=$("${TOOLS[@]}" record --out "$OUT" --part "$name" --rc "$rc" --seconds $((SECONDS - begun)) \
        --limit "$limit" --log "$WORK/$name.log" --work "$WORK")
    echo "gpu_suite: $name: ${status:-not recorded} in $((SECONDS - begun)) s (exit status $rc)" | tee -a "$OUT/suite.log"
done

"${TOOLS[@]}" finish --out "$OUT" ${ONLY:+--only $ONLY}
verdict=$?
cat "$OUT/suite.md"
exit "$verdict"
