"""CUDA tensors inside one host: collectives and point-to-point over a per-group
workspace that every member maps through CUDA IPC, with Triton kernels for the flags and
the reductions and the copy engines for data movement (chorus.cuda.component).

Loaded by name when a group sees its first CUDA call; ``import chorus`` never imports it
(nor torch, triton or cuda-bindings).

Settings (environment, read when a group attaches):

=============================  =======  =========  ============================================
name                           type     default    meaning
=============================  =======  =========  ============================================
CHORUS_CUDA_WORKSPACE_BYTES    int      67108864   bytes of each rank's workspace per group
                                                   (1 MiB .. 4 GiB); half are the collective
                                                   slots, half the point-to-point channels
CHORUS_CUDA_STAGING            bool     0          1: never map peers' memory; stage every
                                                   op through pinned host memory and chorus's
                                                   CPU components (what a failed IPC check
                                                   falls back to)
=============================  =======  =========  ============================================
"""
