# Every GPU check and benchmark (what `make bench-gpu` runs), for the device tool: installs the carried
# wheels (.whl: the project's grpc/protobuf/otel/numpy pins for Python 3.12), then writes logs and JSON
# under $OUT (default bench/results). Each part has its own time limit; PARTS picks and orders them
# (default: all, in this order), e.g. PARTS="sweep graphs llm" for a short lease.
OUT=${OUT:-bench/results}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
PARTS=${PARTS:-"check bench sweep graphs worker mesh llm"}
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD/gen/python:$PWD || exit 3; fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,clocks.max.mem --format=csv
python3 -c "import numba,torch;from numba import cuda;print('numba',numba.__version__,'torch',torch.__version__,cuda.is_available(),cuda.get_current_device().name)" 2>&1 | tail -2
for part in $PARTS; do
  started=$(date +%s)
  case $part in
    check) timeout 120 python3 -m bench.kernels.bench_gpu_kernel_check --output $OUT/gpu_kernel_check.json > $OUT/check.log 2>&1 ;;
    bench) timeout 300 python3 -m bench.kernels.bench_kernels --gpu-only --repeats 30 --output $OUT/kernels_gpu.json > $OUT/bench.log 2>&1 ;;
    sweep) timeout ${SWEEP_TIMEOUT:-170} python3 -m bench.kernels.bench_gpu_attention_sweep --budget-s ${SWEEP_BUDGET:-120} --output $OUT/gpu_attention_sweep.json > $OUT/sweep.log 2>&1 ;;
    graphs) timeout 120 python3 -m bench.worker.bench_gpu_graphs --output $OUT/gpu_graphs.json > $OUT/graphs.log 2>&1 ;;
    worker) timeout 100 python3 -m bench.worker.bench_gpu_worker --output $OUT/worker_gpu.json > $OUT/worker.log 2>&1 ;;
    mesh) timeout 100 python3 -m bench.worker.bench_gpu_mesh --output $OUT/gpu_mesh.json > $OUT/mesh.log 2>&1 ;;
    llm) timeout ${LLM_TIMEOUT:-240} python3 -m bench.worker.bench_gpu_llm ${LLM_ARGS:---large} --output $OUT/gpu_llm.json > $OUT/llm.log 2>&1 ;;
    *) echo "unknown part $part"; continue ;;
  esac
  echo "$part rc $? in $(( $(date +%s) - started )) s"
done
for part in $PARTS; do
  case $part in
    check) grep -E "FAIL|ok in" $OUT/check.log | tail -n 8 ;;
    bench) grep -E "^(paged|write|prepro|device|fast|  write)" $OUT/bench.log | cut -c1-190 | tail -n 60 ;;
    sweep) grep -E "BEST|failing|Error" $OUT/sweep.log | cut -c1-220 ;;
    graphs) tail -n 25 $OUT/graphs.log | cut -c1-220 ;;
    worker) tail -n 20 $OUT/worker.log | cut -c1-300 ;;
    mesh) tail -n 3 $OUT/mesh.log | cut -c1-400 ;;
    llm) tail -n 30 $OUT/llm.log | cut -c1-220 ;;
  esac
done
