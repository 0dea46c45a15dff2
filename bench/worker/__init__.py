"""The worker: its threads sized to the machine or to its share, and (bench_gpu_*, `make bench-gpu`) its
demo models on CUDA against the CPU, in-process and through the mesh."""
