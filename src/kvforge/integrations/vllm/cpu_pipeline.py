"""Pipeline parallelism with `enforce_eager` on vLLM 0.32's CPU runner (imports vLLM;
called by `register()` in every vLLM process).

A worker of a later pipeline stage copies the previous stage's output into buffers
(`GPUModelRunner.intermediate_tensors`) that vLLM makes only inside a dummy forward pass.
The CPU worker runs that pass only to warm up a compiled model (`CPUModelRunner.
warming_up_model` returns at once in eager mode), so an eager run with
pipeline_parallel_size > 1 dies on its first step at
`assert self.intermediate_tensors is not None` (gpu_model_runner.py,
`sync_and_gather_intermediate_tensors`), for any model. The wrap below makes those buffers
right after the model loads, with the call, size and dtype the dummy pass uses; a dummy
pass that runs later finds them made and keeps them. The first stage and runs without
pipeline parallelism are untouched.
"""

from __future__ import annotations

from typing import Any


def register_cpu_pipeline_buffers() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner.load_model
    if getattr(original, "_kvforge_pipeline", False):
        return

    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        from vllm.distributed import get_pp_group

        original(self, *args, **kwargs)
        make_stage_input_buffers(self, get_pp_group().is_first_rank)

    load_model._kvforge_pipeline = True  # type: ignore[attr-defined]
    CPUModelRunner.load_model = load_model  # type: ignore[method-assign]


def make_stage_input_buffers(runner: Any, is_first_stage: bool) -> None:
    """The buffers a later pipeline stage receives into, as the dummy pass makes them (the
    first stage receives nothing; buffers already made are kept)."""
    if is_first_stage or runner.intermediate_tensors is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
