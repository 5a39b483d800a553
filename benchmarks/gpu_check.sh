#!/usr/bin/env bash
# The GPU checks in one run (issues 9 and 14), for a lent accelerator whose time is short:
#   1. benchmarks/engine.py on CUDA at its default size, BLADE at the reference's 4 rows x 4 micro-batches
#      (one forward per micro-batch, then each step's micro-batches stacked in one, the CUDA default) and
#      at one micro-batch of 16 rows (the same effective batch, a quarter of the launches), each beside
#      full-parameter GradDiff at the same rows: tokens/s, peak memory and MFU;
#   2. `blade bench --synthetic --quick` at the `large` size (64 M parameters), its models pretrained and
#      fine-tuned on the GPU (--build-device cuda), for four methods on forget01, with the selection on the
#      validation world as usual; and, beside it, one unlearn request end to end through `blade up` (API +
#      Celery worker + SQLite) trained on the GPU (bf16 + gradient checkpointing, the worker's CUDA
#      defaults), then the same request with `stacked_forward=off`: request, events and metrics as JSON.
#      The requests share the GPU with the bench, so their times are an upper bound; they check that the
#      service's CUDA path works.
# Each step has its own time limit and writes under OUT as it goes, so a failure or a timeout in one step
# still leaves the others' figures.
#
#   OUT=out/gpu PY=.venv/bin/python DEVICE=cpu SIZE=test BUILD=cpu JOBS=2 benchmarks/gpu_check.sh  # rehearsal
#   OUT=$OUT DEMO=.devrun/demo benchmarks/gpu_check.sh                   # on the device (python3 there)
#
# DEMO: a demo cache dir (`demo-tiny/` + `data/`, as blade_core.demo writes it) built beforehand, so the
# device spends no time training the demo model:
#   .venv/bin/python -c "from blade_core.demo import ensure_demo_model; ensure_demo_model('.devrun/demo')"
# WHEELS: a folder of wheels the device's Python lacks (the service's dependencies, for Python 3.12, and
# opentelemetry-api, which fastapi 0.165 imports), installed into /tmp/site first. BUDGET: seconds the whole
# run may take. ENGINE=0 skips step 1 (on the H200 two shapes took 50 s, so its four about 100 s; the bench
# needs 8-9 minutes to finish); COMPILE=1 adds to it 16 x 1 without checkpointing, eager and under
# torch.compile's reduce-overhead mode, the compiled call also checking BLADE's outer losses and gradients
# against eager (`compile_check`: one more compilation; up to 330 s more in all); SWIGLU=1 adds BLADE's
# 4 x 4 step without checkpointing with its SwiGLU activations recomputed, then kept (about 60 s). REQUEST=0 skips step 2,
# which then needs no DEMO, and leaves the GPU to the bench.
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the results}
PY=${PY:-python3}
DEMO=${DEMO:-.devrun/demo}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-480}
DEVICE=${DEVICE:-cuda}
ENGINE_STEPS=${ENGINE_STEPS:-3}
SIZE=${SIZE:-large}     # the bench's --model-size
BUILD=${BUILD:-cuda}    # the bench's --build-device
JOBS=${JOBS:-12}        # the bench's --jobs
ENGINE=${ENGINE:-1}
COMPILE=${COMPILE:-0}   # 1: step 1 also runs 16 x 1 with every decoder layer compiled (CUDA graphs)
SWIGLU=${SWIGLU:-0}     # 1: step 1 also runs 4 x 4 without checkpointing, SwiGLU activations recomputed and kept
REQUEST=${REQUEST:-1}
start=$SECONDS
WORK=/tmp/gpu-check
rm -rf "$WORK" && mkdir -p "$OUT" "$WORK"
# Everything lands in WORK; after each step one archive of it goes to OUT (the device returns few files),
# with the bench's cached selection runs (each a row.json and history.json). A run's weights live in its
# folder only while it trains; they stay out, or a save mid-run would outgrow what the device returns.
save() {
    tar -C /tmp --exclude='*.safetensors' --exclude='*.bin' -czf "$OUT/gpu-check.tgz" gpu-check \
        $(cd /tmp && ls -d bench-cache/selection 2>/dev/null)
}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    nproc
    "$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$WORK/env.txt"
# Fail in seconds, not minutes, when an import is missing (a rerun then still fits the device time).
"$PY" -c "import blade_service.api.main, blade_service.worker.tasks, blade_core.unlearn, rouge_score" \
    2>&1 | tee -a "$WORK/env.txt" || exit 1

left() { echo $((BUDGET - (SECONDS - start))); }

echo "== 1. engine benchmark on $DEVICE: 4 x 4 rows (unstacked, then auto), then 16 x 1 =="
# Each shape: rows, micro-batches, torch.compile mode (- for eager), checkpointing (ckpt or nockpt), BLADE's
# --stacked-forward, and optionally forget/retain tokens a row (default 128 both; 40/32 is our worlds' QA rows, so
# the one-pass comparison pays for padding). GradDiff's backward fails under CUDA graphs with checkpointing
# (pytorch/pytorch#169545), so the compiled pair runs without it, eager beside it, for a like-for-like ratio.
shapes=("4 4 - ckpt off" "4 4 - ckpt auto" "4 4 - ckpt auto 40/32" "16 1 - ckpt auto")
[ "$COMPILE" = 0 ] || shapes+=("16 1 - nockpt auto" "16 1 reduce-overhead nockpt auto")
# A 7th field `kept`: BLADE with its SwiGLU activations kept (--no-recompute-swiglu; blade_core/swiglu.py).
# Without checkpointing, where the saving shows in peak memory; `-` in the 6th: 128 tokens.
[ "$SWIGLU" = 0 ] || shapes+=("4 4 - nockpt auto" "4 4 - nockpt auto - kept")
[ "$ENGINE" = 0 ] || for shape in "${shapes[@]}"; do
    set -- $shape
    mode=${3#-}
    seq=${6:-}; seq=${seq#-}
    timeout $((${mode:+120} + 75)) "$PY" benchmarks/engine.py --device "$DEVICE" --steps "$ENGINE_STEPS" \
        --skip-entropy --batch "$1" --grad-accum "$2" ${mode:+--compile "$mode"} \
        $([ "$4" = nockpt ] && echo --no-checkpointing) --stacked-forward "$5" \
        ${seq:+--seq ${seq%/*} --retain-seq ${seq#*/}} $([ "${7:-}" = kept ] && echo --no-recompute-swiglu) \
        --json "$WORK/engine-batch$1-accum$2${mode:+-$mode}-$4-$5${seq:+-seq${seq/\//-}}${7:+-$7}.json" 2>&1 |
        tee -a "$WORK/engine.txt"
done
save

echo "== 2. one request end to end (blade up), beside the bench (left: $(left) s; REQUEST=$REQUEST) =="
request() {
    local data=/tmp/blade-gpu-var port=8765 t0 rc up
    rm -rf "$data"
    "$PY" -m blade_service.cli up --port $port --data-dir "$data" \
        --demo-model "$DEMO/demo-tiny" --demo-data "$DEMO/data" >"$WORK/up.log" 2>&1 &
    up=$!
    for _ in $(seq 240); do
        [ -s "$data/admin-key" ] && grep -q "KEY=" "$WORK/up.log" && break
        kill -0 $up 2>/dev/null || { echo "blade up exited"; tail -20 "$WORK/up.log"; return 1; }
        sleep 0.5
    done
    export BLADE_API_URL=http://127.0.0.1:$port BLADE_API_KEY
    BLADE_API_KEY=$(cat "$data/admin-key")
    # BLADE's defaults (`stacked_forward` auto: stacked on CUDA), then one forward per micro-batch, each on a
    # clean stack: the first adapter is rolled back before the second request.
    rc=0
    for mode in auto off; do
        t0=$SECONDS
        "$PY" -m blade_service.cli submit --base-model demo-tiny --forget "$DEMO/data/forget01_perturbed.json" \
            --retain "$DEMO/data/retain99.json" --set stacked_forward=$mode --wait --timeout "$1" --json \
            >"$WORK/request-$mode.json" 2>>"$WORK/submit.log" || rc=$?
        echo "request (stacked_forward $mode) ended (rc $rc) $((SECONDS - t0)) s after submission"
        "$PY" - "$WORK/request-$mode.json" >"$WORK/ids-$mode.txt" <<'PYEOF'
import json, sys
req = json.load(open(sys.argv[1]))
print(req["id"], req.get("adapter_id") or "")
keys = ("id", "status", "method", "params", "error", "run_status", "progress")
print(json.dumps({k: req[k] for k in keys if k in req}, indent=1)[:4000], file=sys.stderr)
print(json.dumps(req.get("metrics"), indent=1)[:4000], file=sys.stderr)
PYEOF
        read -r id adapter <"$WORK/ids-$mode.txt"
        "$PY" -m blade_service.cli status "$id" --events --json >"$WORK/events-$mode.json" 2>>"$WORK/submit.log"
        [ -z "$adapter" ] || "$PY" -m blade_service.cli rollback "$adapter" --cascade \
            --reason "gpu_check: a clean stack for the next request" >/dev/null 2>>"$WORK/submit.log"
    done
    kill -INT $up
    for _ in $(seq 40); do kill -0 $up 2>/dev/null || break; sleep 0.5; done
    pkill -9 -f "blade_service.cli up" 2>/dev/null
    cp "$data/logs/worker.log" "$data/logs/api.log" "$WORK/" 2>/dev/null
    return $rc
}
requesting=
[ "$REQUEST" = 0 ] || { request $((($(left) - 40) / 2)) >"$WORK/request.txt" 2>&1 & requesting=$!; }

echo "== 3. the quick bench at size $SIZE, built on $BUILD (left: $(left) s) =="
(while sleep 60; do save; done) &  # a call cut off at its limit still returns the runs finished by then
saving=$!
timeout $(($(left) - 20)) "$PY" -m blade_service.cli bench --synthetic --quick --model-size "$SIZE" \
    --build-device "$BUILD" --jobs "$JOBS" --no-progress --methods blade,grad_diff,npo,rmu --splits forget01 \
    --lr-grid-extend 0 --cache /tmp/bench-cache --out "$WORK/bench" 2>&1 | tail -c 200000 >"$WORK/bench.txt"
echo "bench exit status ${PIPESTATUS[0]}"
kill $saving 2>/dev/null; wait $saving 2>/dev/null
tail -40 "$WORK/bench.txt"
for f in /tmp/bench-cache/models/*/*/build_info.json; do
    [ -f "$f" ] && cp "$f" "$WORK/build_info-$(basename "$(dirname "$(dirname "$f")")")-$(basename "$(dirname "$f")").json"
done
save
if [ -n "$requesting" ]; then
    wait $requesting
    cat "$WORK/request.txt"
    save
fi
echo "total $((SECONDS - start)) s"
