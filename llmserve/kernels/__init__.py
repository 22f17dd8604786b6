"""Compute kernels: the native CPU kernels (cpu/: GEMMs, attention, the decoder stack, fused ops, the sampler;
built and bound by native.py) and the measured choice between equivalent paths on the running machine (choice.py,
calibrate.py). Python attention backends live in llmserve/attention and call into native.py."""
