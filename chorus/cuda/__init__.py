"""CUDA tensors inside one host: collectives and point-to-point over a per-group
workspace that every member maps through CUDA IPC, with Triton kernels for the flags and
the reductions and the copy engines for data movement (chorus.cuda.component).

Loaded by name when a group sees its first CUDA call; ``import chorus`` never imports it
(nor torch, triton or cuda-bindings).

Settings (declared in chorus.config, read when a group attaches):
``CHORUS_CUDA_WORKSPACE_BYTES`` (each rank's workspace per group) and
``CHORUS_CUDA_STAGING`` (stage every op through pinned host memory).  Read (declared in
chorus.config too) by chorus.cuda.launchers, diagnostics: ``CHORUS_CUDA_FAST_LAUNCH=0``
(every launch through Triton's JIT binding instead of the cached launcher) and
``CHORUS_CUDA_HINTS=0`` (no vectorisation hints in the fused all_reduce kernels).
"""
