"""``chorus bench``: nccl-tests-style sweeps of chorus against torch gloo, in one run."""
