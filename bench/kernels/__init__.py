"""The kernels: CPU twins against PyTorch (bench_kernels), and on a GPU (bench_gpu_*, `make bench-gpu`)
checked against float64 references, timed against the bandwidth floor, and the attention layouts swept."""
