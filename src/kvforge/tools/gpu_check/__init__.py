"""`python -m kvforge.tools.gpu_check` / `kvforge gpu-check`: every cache method on a device,
compared with the CPU float32 PyTorch reference, at tiny and real sizes; then a short
speed section through the `bench` commands. See docs/commands.md#gpu-check."""
