# Every GPU check and benchmark of issue 19 in one go (what `make bench-gpu` runs), for the device tool:
# installs the carried wheels (.whl: the project's grpc/protobuf/otel/numpy pins for Python 3.12), then
# writes logs and JSON under $OUT (default bench/results). Each step has its own time limit.
OUT=${OUT:-bench/results}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD/gen/python:$PWD || exit 3; fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,clocks.max.mem --format=csv
python3 -c "import numba,torch;from numba import cuda;print('numba',numba.__version__,'torch',torch.__version__,cuda.is_available(),cuda.get_current_device().name)" 2>&1 | tail -2
timeout 120 python3 -m bench.kernels.bench_gpu_kernel_check --output $OUT/gpu_kernel_check.json > $OUT/check.log 2>&1; echo "check rc $?"
timeout 300 python3 -m bench.kernels.bench_kernels --gpu-only --repeats 30 --output $OUT/kernels_gpu.json > $OUT/bench.log 2>&1; echo "bench rc $?"
timeout 150 python3 -m bench.kernels.bench_gpu_attention_sweep --budget-s 100 --output $OUT/gpu_attention_sweep.json > $OUT/sweep.log 2>&1; echo "sweep rc $?"
timeout 100 python3 -m bench.worker.bench_gpu_worker --output $OUT/worker_gpu.json > $OUT/worker.log 2>&1; echo "worker rc $?"
timeout 100 python3 -m bench.worker.bench_gpu_mesh --output $OUT/gpu_mesh.json > $OUT/mesh.log 2>&1; echo "mesh rc $?"
grep -E "FAIL|ok in" $OUT/check.log | tail -n 8; grep -E "^(paged|write|prepro|device|fast|  write)" $OUT/bench.log | cut -c1-190 | tail -n 60; grep -E "DEFAULT|layouts" $OUT/sweep.log; tail -n 20 $OUT/worker.log | cut -c1-300; tail -n 3 $OUT/mesh.log | cut -c1-400
