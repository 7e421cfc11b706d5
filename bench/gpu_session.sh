#!/usr/bin/env bash
# A GPU session's measurements (issue 52), in three calls of the device tool; torch alone there (no Ray, no
# pydantic), so each part is a `python3 -m bench.<module>` of its own, under a time limit of its own.
#
#   parts   smoke: `bench.gpu_smoke`, every one-rank variant on CUDA against the CPU or its fp32 twin
#           step:  `bench.gpu`, trainyard / plain loop and the memory plan: GPT-2 medium (seq 1024, with the
#                  diagnostic sides) and TinyLlama 1.1B's shape (seq 2048)
#           compile: the same two with every block compiled
#           profile: `bench.gpu_profile` of GPT-2 medium (op tables in the log: what a missed ratio is made of)
#           big:   `bench.gpu_big`, a 7B Llama past the device's memory with optimizer offload and full recompute
#   usage   bash bench/gpu_session.sh smoke step profile   (the first call: about 4 minutes expected)
#           bash bench/gpu_session.sh big                  (the second, on the machine still warm: about 4)
#           bash bench/gpu_session.sh compile              (the third: about 3; the machine stays warm 30 s)
#           DEVICE=cpu bash bench/gpu_session.sh smoke step compile big   (tiny shapes on a CPU: the path, no figures)
#   Each part has a time limit of its own (below); the limits of a call's parts add up to more than a call's 600 s,
#   so that one slow part does not take the others' time: a part cut off leaves its rc and the others' files.
#
# Before the first call, once, here (the device lacks annotated_types, which parallel.config imports, and torchao,
# which adamw8bit needs):
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform any -d .whl annotated-types==0.8.0 torchao==0.18.0
# and each call names `.whl` in `carry`, with timeout_s 590. The session's 15 minutes of device time hold the
# start (1-2 minutes) and the three calls with a little to spare: no part can run twice. What comes back from $OUT
# (at most 8 files a call): one JSON a part (smoke.json, step-gpt2.json, step-llama.json, big.json,
# step-gpt2-compile.json, step-llama-compile.json), session.log (every part's output) and summary.txt (the device,
# each part's exit code and time, the table). Then, here: `.venv/bin/python -m bench.gpu_record FILES_AT...
# --commit SHA` (each call's files_at, the commit that ran) writes them into bench/results.json's section gpu, and
# `python -m bench.report` the table (BENCHMARKS.md needs its `<!-- table: gpu -->` marker the first time).
set -u
OUT=${OUT:-/tmp/gpu-session}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

# each carried wheel whose package the device's python lacks
for wheel in .whl/*.whl; do
    [ -e "$wheel" ] || continue
    package=$(basename "$wheel" | cut -d- -f1)
    "$PY" -c "import $package" 2>/dev/null && continue
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel" || exit 1
done
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    git rev-parse HEAD 2>/dev/null || echo "commit unknown (no .git)"
    [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch; print('torch', torch.__version__)"
} >> "$OUT/summary.txt" 2>&1

# part NAME SECONDS COMMAND...: run it under its limit, its output to session.log, its exit code and time to summary
part() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "===== $name: $*" >> "$OUT/session.log"
    timeout -k 10 "$limit" "$@" >> "$OUT/session.log" 2>&1
    rc=$?
    echo "$name rc=$rc$([ $rc = 124 ] && echo " (timed out at ${limit} s)") $(( $(date +%s) - start ))s" \
        >> "$OUT/summary.txt"
}

if [ "$DEVICE" = cuda ]; then
    GPT2=(--model gpt2-medium) LLAMA=(--model llama-1b) ROUNDS=(--warmup 3 --steps 10 --rounds 4) BIG=()
else  # the same path on tiny shapes
    GPT2=(--model tiny) LLAMA=(--model tiny-llama) ROUNDS=(--warmup 1 --steps 2 --rounds 2 --peak-tflops 1)
    BIG=(--tiny)
fi
STEP=("$PY" -m bench.gpu --device "$DEVICE" "${ROUNDS[@]}")

for what in "$@"; do
    case $what in
        smoke) part smoke 150 "$PY" -m bench.gpu_smoke --device "$DEVICE" --out "$OUT/smoke.json" ;;
        step)
            part step-gpt2 120 "${STEP[@]}" "${GPT2[@]}" --diagnose --out "$OUT/step-gpt2.json"
            part step-llama 150 "${STEP[@]}" "${LLAMA[@]}" --out "$OUT/step-llama.json"
            ;;
        compile)
            part step-gpt2-compile 180 "${STEP[@]}" "${GPT2[@]}" --compile --out "$OUT/step-gpt2-compile.json"
            part step-llama-compile 200 "${STEP[@]}" "${LLAMA[@]}" --compile --out "$OUT/step-llama-compile.json"
            ;;
        profile) part profile 90 env OUT=/tmp "$PY" -m bench.gpu_profile --device "$DEVICE" "${GPT2[@]}" ;;
        big) part big 420 "$PY" -m bench.gpu_big --device "$DEVICE" "${BIG[@]}" --out "$OUT/big.json" ;;
        *) echo "unknown part $what (smoke, step, compile, profile, big)" >&2; exit 2 ;;
    esac
done
"$PY" -m bench.gpu_record --summary "$OUT" >> "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
