"""The device data plane: collectives on device tensors (CUDA with NCCL, or staged through
pinned host memory and the CPU planes), plugged into the engine's executor (docs/gpu.md).

Must not touch: the engine's negotiation, framework APIs above torch tensors.
"""
