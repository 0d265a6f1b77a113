#!/usr/bin/env bash
# Everything that needs the GPU, in one call: the GPU tests, then the benchmarks.
#   benchmarks/gpu_suite.sh                 # all parts
#   benchmarks/gpu_suite.sh tests decode    # some parts: tests attention decode generate finetune lora
#                                           # step_profile spec structured soak load serve (each benchmarks/PART.py)
#   GPU_TESTS="tests/test_engine.py" benchmarks/gpu_suite.sh tests    # some GPU test files
# Results go to benchmarks/results/; where $OUT is set (the device machine) logs and a tarball of the
# results are copied there too. Wheels in .whl/ (the web stack the GPU machine lacks) are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
results=benchmarks/results
logs=${OUT:-$results}
mkdir -p "$results" "$logs"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests attention decode generate finetune load serve)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$logs/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$logs/gpu.txt"

status=0
for part in "${parts[@]}"; do
    echo "=== $part ($(date -u +%T))"
    if [ "$part" = tests ]; then
        # GPU_TESTS narrows the run to some files or -k expressions (the whole GPU suite takes about 8 minutes)
        python3 -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-tests} 2>&1 | tee "$logs/gpu_tests.txt" | tail -n 40
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    else
        python3 "benchmarks/$part.py" --out "$results" 2>&1 | tee "$logs/bench_$part.txt" | tail -n 60
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    fi
done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" "$results"; fi
exit $status
