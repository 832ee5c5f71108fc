# CPU allocator settings, sourced by tools/demo.sh and tools/test.sh; source it before your own
# CPU runs (calibration, evaluation) for the same effect:   source tools/cpu_env.sh
#
# glibc serves large allocations with a fresh mmap and unmaps them on free, so every forward
# pass page-faults its activations in again (system time). Raising the mmap and trim thresholds
# keeps freed memory in the heap for the next pass: the same figures, less time, about the same
# peak resident set (memory freed after a peak stays with the process). benchmarks/allocator.py
# measures it (results/allocator_cpu.json; docs/mmdet.md#cpu-allocator). A value already set is kept.
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1099511627776}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-1099511627776}"
