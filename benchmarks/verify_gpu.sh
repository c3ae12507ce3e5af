#!/usr/bin/env bash
# Verify accelfn on an NVIDIA GPU machine in one command (issue 11): under 9 minutes on one H100.
#
#     bash benchmarks/verify_gpu.sh                 # from anywhere; it runs in the repo root
#     OUT=/tmp/verify bash benchmarks/verify_gpu.sh  # where the logs go (default runs/verify_gpu)
#
# Needs no network and nothing but the machine's python (torch, transformers, accelerate) plus wheels carried
# in .whl/ (optree, typeguard, torchao, ...: installed with --no-index into $VERIFY_SITE, default /tmp/site).
# accelfn itself is not installed: the repo root goes on PYTHONPATH.
#
# Phases (each runs even if an earlier one failed; each has a timeout within the total budget):
#   env               nvidia-smi, python/torch/CUDA versions; fails without a usable CUDA device
#   gpu-tests         python -m pytest tests/test_gpu.py -m gpu -x -q
#   placement-tests   python -m pytest tests/test_device_placement.py -x -q   (if that file exists)
#   demo-launch       the README demo on the GPU: accelfn launch --nproc-per-node 1 examples/train_lm.py --steps 200
#   demo-plain        python examples/train_lm.py --steps 100
#   sdpa-mask         benchmarks/step_kernels.py --modes eager,eager-mask,compile-skipmask --steps 5 (about 2 min
#                     on an H100; VERIFY_MASK_PROFILE=0 skips it): the 0.89B step's kernel time by kind with
#                     transformers' causal mask run eagerly and removed under compile (docs/dry_run.md item 9);
#                     its JSON goes to $OUT/step_kernels_mask.json
#   throughput        benchmarks/gpu_throughput.py on the 0.4b model with the rest of the budget;
#                     its table goes to $OUT/gpu_throughput.md, each configuration's log to $OUT/gpu_throughput_logs/
# It ends with one summary line (also in $OUT/summary.txt); the exit status is 1 if any phase failed, timed out
# or was skipped for lack of time.
#
# Settings (environment): OUT, VERIFY_BUDGET_S (total seconds, default 510), VERIFY_SITE, PYTHON (default
# python, else python3), VERIFY_THROUGHPUT_ARGS (default "--model 0.4b --steps 20 --loss-steps 100 --timeout 180").
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$(pwd)
OUT=${OUT:-runs/verify_gpu}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT/gpu_throughput.md" "$OUT/gpu_throughput_logs" "$OUT/summary.txt"  # nothing stale from a last run
BUDGET=${VERIFY_BUDGET_S:-510}
SITE=${VERIFY_SITE:-/tmp/site}
THROUGHPUT_ARGS=${VERIFY_THROUGHPUT_ARGS:---model 0.4b --steps 20 --loss-steps 100 --timeout 180}
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif command -v python >/dev/null 2>&1; then PY=python
else PY=python3
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
START=$SECONDS

NAMES=()
STATUS=()
FAILED=0

record() {  # record NAME STATUS
    NAMES+=("$1")
    STATUS+=("$2")
    [[ "$2" == pass* || "$2" == absent* || "$2" == off* ]] || FAILED=1
}

left() { echo $((BUDGET - (SECONDS - START))); }

# phase NAME CAP_SECONDS COMMAND...: run COMMAND with timeout min(CAP, budget left), output to the console
# and to $OUT/NAME.log
phase() {
    local name=$1 cap=$2
    shift 2
    local t
    t=$(left)
    ((cap < t)) && t=$cap
    if ((t < 15)); then
        echo "=== $name: skipped, only $(left) s of the ${BUDGET} s budget left" | tee "$OUT/$name.log"
        record "$name" "skipped(budget)"
        return
    fi
    echo "=== $name (timeout ${t} s, $((SECONDS - START)) s elapsed): $*"
    local t0=$SECONDS rc
    rm -f "$OUT/$name.rc"
    {
        echo "\$ $*"
        timeout -k 15 "$t" "$@" 2>&1
        echo $? >"$OUT/$name.rc"
    } | tee "$OUT/$name.log"
    rc=$(cat "$OUT/$name.rc" 2>/dev/null || echo 1)
    rm -f "$OUT/$name.rc"
    local took=$((SECONDS - t0))
    if ((rc == 0)); then
        record "$name" "pass(${took}s)"
    elif ((rc == 124 || rc == 137)); then
        record "$name" "TIMEOUT(${t}s)"
    else
        record "$name" "FAIL(rc=$rc,${took}s)"
    fi
    echo "=== $name: ${STATUS[-1]}"
}

# (a) carried wheels
if compgen -G ".whl/*.whl" >/dev/null; then
    echo "=== installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        2>&1 | tee "$OUT/wheels.log"; then
        record wheels "pass"
    else
        record wheels "FAIL"
    fi
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "=== no .whl/ folder: using what $PY has"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

# (b) the machine
cat >"$OUT/env_check.py" <<'EOF'
import importlib.metadata as md, platform, sys
import torch
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}")
for dist in ("transformers", "accelerate", "torchao", "optree", "typeguard", "pytest"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist}: not installed")
import accelfn
print(f"accelfn {accelfn.__version__} from {accelfn.__file__}")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB")
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
import time
t0 = time.perf_counter()
for _ in range(20):
    y = x @ x
torch.cuda.synchronize()
print(f"bf16 4096^3 matmul: {20 * 2 * 4096**3 / (time.perf_counter() - t0) / 1e12:.0f} TFLOP/s (first calls included)")
EOF
phase env 90 bash -c 'nvidia-smi || echo "(nvidia-smi failed or is missing)"; exec "$0" "$1"' "$PY" "$OUT/env_check.py"

# (c) the GPU tests
phase gpu-tests 200 "$PY" -m pytest tests/test_gpu.py -m gpu -x -q -p no:cacheprovider
if [[ -f tests/test_device_placement.py ]]; then
    phase placement-tests 120 "$PY" -m pytest tests/test_device_placement.py -x -q -p no:cacheprovider
else
    record placement-tests "absent"
fi

# (d) the README demo, on the GPU (no --cpu), under the launcher and as a plain script
phase demo-launch 120 "$PY" -m accelfn.cli.main launch --nproc-per-node 1 examples/train_lm.py --steps 200
phase demo-plain 90 "$PY" examples/train_lm.py --steps 100

# (e) what SDPA costs with transformers' causal mask (the compiled attention's 3.3x: docs/dry_run.md item 9)
if [[ ${VERIFY_MASK_PROFILE:-1} != 0 ]]; then
    phase sdpa-mask 200 "$PY" benchmarks/step_kernels.py --modes eager,eager-mask,compile-skipmask --steps 5 \
        --out "$OUT/step_kernels_mask.json"
else
    record sdpa-mask "off"
fi

# (f) throughput, with what is left of the budget (minus a margin for the summary)
T=$(($(left) - 10))
# shellcheck disable=SC2086  # THROUGHPUT_ARGS is a list of words
phase throughput "$T" "$PY" benchmarks/gpu_throughput.py $THROUGHPUT_ARGS --budget $((T - 20)) \
    --markdown "$OUT/gpu_throughput.md" --logs "$OUT/gpu_throughput_logs"

# (g) summary
LINE="verify_gpu: $( [[ $FAILED == 0 ]] && echo PASS || echo FAIL ) in $((SECONDS - START)) s:"
for i in "${!NAMES[@]}"; do LINE+=" ${NAMES[$i]}=${STATUS[$i]}"; done
echo
[[ -f "$OUT/gpu_throughput.md" ]] && cat "$OUT/gpu_throughput.md" && echo
echo "$LINE" | tee "$OUT/summary.txt"
echo "logs: $OUT"
exit $FAILED
