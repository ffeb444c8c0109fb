"""A CUDA graph's capture and replay, emulated on CPU tensors.

A captured graph does not rerun Python: it relaunches the kernels its capture recorded, on
the very memory they read and wrote then, with the scalars (sizes, grids, Python ints)
they had then. A static decode step that runs correctly eagerly can therefore still replay
wrongly: a value computed on the host from one step's data and baked into a launch, a
tensor made afresh for a step instead of written into a fixed buffer, metadata cached on
first use, or an intermediate the next step expects Python to recompute.

`RecordedGraph` is that semantics on the CPU. While `recording(graph)` is active, every
aten operation (kvforge's C++ kernels included: they are TORCH_LIBRARY operators) and
every Triton launch in the interpreter is executed and kept with its exact arguments: the
same tensor objects (fixed addresses) and the same scalars. Since a CUDA capture executes
nothing, the recording then undoes what the operations wrote into tensors that existed
before it, and fills the tensors they allocated with garbage. `replay()` runs the
operations again in order; one whose result was a fresh tensor writes the new result into
the tensor the capture made (an allocation alone writes nothing), so later operations,
and whatever Python kept (the logits, tensors left on the step metadata), see this
replay's values, as they would in a graph's memory pool. Reading a device value on the
host through an aten operation (`item`, `bool(t)`, `nonzero`, a boolean mask,
`repeat_interleave` without `output_size`) fails the recording, as it fails a capture on
CUDA, and so does making a tensor from Python data (on CUDA a host-to-device copy no replay
renews).

What it cannot see: which tensors are host memory (everything is on the CPU, so work
that CUDA would run on the host once, at capture, is replayed here: more lenient than a
graph); host reads that bypass aten (`tolist`, `numpy`: sync_counter.py counts those);
memory a graph's pool reuses within a capture (every tensor the capture made stays alive
here, so a raw address kept past its tensor's life stays valid); CUDA-only calls the CPU
path never makes (events, streams); kernels' own correctness (their parity tests hold that).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# aten operations whose result the host needs before it can go on (illegal in a capture)
# or whose output shape depends on tensor values (a replay could not write it in place)
HOST_READS = {"_local_scalar_dense", "is_nonzero", "item", "equal", "nonzero", "nonzero_numpy", "masked_select",
              "unique_dim", "_unique", "_unique2", "unique_consecutive", "unique_dim_consecutive", "bincount"}
# operations that only allocate: a replay of them writes nothing
ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}


class CaptureError(RuntimeError):
    """What a CUDA graph capture would refuse, or could not replay."""


class RecordedGraph:
    """The operations one recorded call ran, replayable on their tensors' current values."""

    def __init__(self) -> None:
        self.ops: list[Callable[[], None]] = []
        self.launches = 0  # Triton kernel launches among `ops`
        self.names: list[str] = []  # each of `ops`: the aten operation's name, or "triton:" and the kernel's
        # the names of the operations that launch a device kernel: Triton launches, and aten
        # operations that write a tensor or make one (not views, aliases and no-op casts)
        self.kernels: list[str] = []
        self.made: list[torch.Tensor] = []  # the tensors the recorded operations allocated
        # (tensor, its contents before the recording first wrote it), for tensors that existed before
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()

    def keep_before_writing(self, tensors: list[torch.Tensor]) -> None:
        """Remember what `tensors` hold before an operation of the recording writes them."""
        made = {id(t) for t in self.made}
        for tensor in tensors:
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if id(tensor) not in made and key not in self._seen:
                self._seen.add(key)
                self._before.append((tensor, tensor.clone()))

    def undo_writes(self) -> None:
        """Put back what the recording wrote into tensors that existed before it (the
        earliest contents last, so overlapping views end as they began)."""
        with torch.inference_mode():
            for tensor, before in reversed(self._before):
                tensor.copy_(before)
        self._before.clear()

    def poison(self) -> None:
        """What a capture leaves in the memory it allocated: a CUDA capture runs no kernel,
        so until the first replay those tensors hold whatever was there. NaN and the
        largest integer stand for it here, so that Python reading one before a replay
        (a tensor made during the capture and kept as state) shows."""
        with torch.inference_mode():
            for tensor in self.made:
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
                elif tensor.dtype == torch.bool:
                    tensor.fill_(True)
                elif not tensor.is_complex():
                    tensor.fill_(torch.iinfo(tensor.dtype).max)

    def replay(self) -> None:
        with torch.inference_mode():  # (a graph records no autograd; its tensors may be inference tensors)
            for op in self.ops:
                op()


def _boolean_index(name: str, args: tuple[Any, ...]) -> bool:
    """Indexing with a boolean mask: its result's shape is the mask's count of True."""
    return name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments `func`'s schema says it writes (in-place and out= arguments)."""
    found: list[torch.Tensor] = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            found.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return found


def _storages(value: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)}


def _rerun(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fresh: list[int],
           captured: list[Any]) -> None:
    again = tree_flatten(func(*args, **kwargs))[0]
    for i in fresh:
        if again[i].shape != captured[i].shape or again[i].dtype != captured[i].dtype:
            raise CaptureError(f"{func} gave a result of {tuple(again[i].shape)} {again[i].dtype} on replay, "
                               f"{tuple(captured[i].shape)} {captured[i].dtype} at capture")
        captured[i].copy_(again[i])


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph
        self.inside_kernel = 0  # > 0 while an interpreted Triton kernel runs (its own copies are not ops)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.inside_kernel:
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if (name in HOST_READS or (name == "where" and len(args) == 1) or _boolean_index(name, args)
                or (name == "repeat_interleave" and len(args) == 1 and kwargs.get("output_size") is None)):
            raise CaptureError(f"a captured step may not read device values on the host ({func})")
        if name == "lift_fresh":  # torch.tensor / as_tensor of Python data
            raise CaptureError("a captured step may not make a tensor from Python data: on CUDA that is a copy "
                               "from the host whose data no replay renews (write it into a fixed buffer instead)")
        self.graph.keep_before_writing(_written(func, args, kwargs))
        out = func(*args, **kwargs)
        captured = tree_flatten(out)[0]
        inputs = _storages((args, kwargs))
        # results in memory no input owns are written back on replay; views and in-place
        # results alias an input, which the replayed operation updates itself
        fresh = [i for i, t in enumerate(captured)
                 if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        self.graph.made.extend(captured[i] for i in fresh)
        if name not in ALLOCATIONS:
            self.graph.ops.append(lambda: _rerun(func, args, kwargs, fresh, captured))
            self.graph.names.append(str(func._schema.name))
            if fresh or _written(func, args, kwargs):
                self.graph.kernels.append(str(func._schema.name))
        return out


_RECORDING: list[RecordedGraph] = []  # the graph being recorded, if any


def active_graph() -> RecordedGraph | None:
    """The graph `recording` is filling now (None outside one): what hooks inside the
    recorded call (a decoder layer's, say) can read, such as how many kernels it holds."""
    return _RECORDING[-1] if _RECORDING else None


@contextmanager
def recording(graph: RecordedGraph) -> Iterator[None]:
    """Run the block as a capture into `graph` (see the module docstring)."""
    recorder = _Recorder(graph)
    _RECORDING.append(graph)
    try:
        with recorder, _triton_launches(recorder):
            yield
    finally:
        _RECORDING.pop()
    graph.undo_writes()
    graph.poison()


@contextmanager
def _triton_launches(recorder: _Recorder) -> Iterator[None]:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # no triton: no kernel can launch
        yield
        return
    launch = InterpretedFunction.run

    def recorded(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if warmup or recorder.inside_kernel:
            return launch(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        if callable(grid):
            raise CaptureError(f"{kernel.__name__}: a grid computed at launch; a graph keeps the one its capture saw "
                               "(pass the grid as a tuple)")
        recorder.inside_kernel += 1  # (the copies kept below are the recording's own, not the step's)
        try:
            # a kernel may write any tensor it is given
            recorder.graph.keep_before_writing([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
            result = launch(kernel, *args, grid=grid, warmup=False, **kwargs)
        finally:
            recorder.inside_kernel -= 1
        recorder.graph.ops.append(lambda: launch(kernel, *args, grid=grid, warmup=False, **kwargs))
        recorder.graph.launches += 1
        recorder.graph.names.append(f"triton:{kernel.__name__}")
        recorder.graph.kernels.append(f"triton:{kernel.__name__}")
        return result

    InterpretedFunction.run = recorded  # type: ignore[method-assign]
    try:
        yield
    finally:
        InterpretedFunction.run = launch  # type: ignore[method-assign]
