"""CUDA kernels in Triton that are not attention (attention/triton_decode.py is with its backend): qblock.py, the
GEMM over block-quantized weights. On a CPU they run only under TRITON_INTERPRET=1 (tests)."""
