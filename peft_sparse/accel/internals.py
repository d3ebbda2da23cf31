"""Every use of a torch or Triton internal by the fast paths, in one place, each with a fallback.

The fast paths lean on a few things torch and Triton do not promise: a tensor's version counter (what
tells a kept result that its inputs changed; the core reads it too, so it is defined in
:mod:`peft_sparse.core.internals` with the current CUDA device), the tensors an autograd node saved (what the input
rebuild reads), the C++ ``Function.apply`` behind the Python wrapper, the autograd engine's end-of-backward
callbacks and the id of the backward pass running, the current raw CUDA stream, and a Triton kernel's compiled-launch cache. Where one of them is
missing or behaves otherwise, the function here says so (a version that equals nothing, no saved tensor,
"hooks active", no callback queue, no kept launch) and the caller takes its reference path: the results
stay the same, only slower. A test makes each of them look absent and checks exactly that.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..core import dispatch as switch_state
from ..core.internals import current_cuda_device, version  # noqa: F401 (the core's own two, with their fallbacks)


HOOKED = object()  # what saved_tensor returns for a tensor packed by saved-tensor hooks (never unpacked)
_RAW_NAMES = {"_saved_self": "_raw_saved_self", "_saved_other": "_raw_saved_other"}  # (no string built per call)


def saved_tensor(node, name: str):
    """The tensor autograd ``node`` saved as ``name`` (``"_saved_self"``…); None when it saved none there
    (or the field does not exist in this torch); :data:`HOOKED`, without unpacking, when saved-tensor hooks
    packed it (unpacking would spend a checkpoint's single unpack, or copy an offloaded tensor back)."""
    raw = getattr(node, _RAW_NAMES.get(name, "_raw" + name), None)
    if raw is not None and getattr(raw, "unpack_hook", None) is not None:
        return HOOKED
    try:
        value = getattr(node, name)
    except (RuntimeError, AttributeError):  # freed, or not a saved field
        return None
    return value if isinstance(value, torch.Tensor) else None


def node_kind(node) -> Optional[str]:
    """The autograd node's class name (``"MulBackward0"``…), by which the input rebuild recognises a product."""
    return type(node).__name__


_TOP_HOOKS = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (checkpointing, offloading) are in force now; True where that cannot be told."""
    if _TOP_HOOKS is None:
        return True
    return _TOP_HOOKS(False) is not None


def direct_apply(function: type, fixed: bool = False) -> Callable:
    """``function.apply`` without ``torch.autograd.Function.apply``'s Python wrapper, which on every call
    builds a closure, inspects ``setup_context`` and unwraps every argument (microseconds of host time per
    layer call, which bounds a training step whose kernels are short). Tensor arguments go through the
    same unwrapping of a dead functorch wrapper (a tensor that escaped a finished transform). While
    functorch transforms are active, under ``torch.compile`` (which knows ``Function.apply``) and with the
    fast paths off, the wrapper's own path. ``fixed``: five arguments (x, bias, spec, indices, values),
    passed by name and unwrapped one by one, without building the argument list."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if active is None or unwrap is None or compiling is None:  # pragma: no cover - another torch: the public path
        return function.apply
    direct = super(torch.autograd.Function, function).apply  # (what the wrapper calls: the C++ apply)
    wrapped = function.apply
    tensor = torch.Tensor
    state = switch_state

    if fixed:

        def apply_fixed(x, bias, spec, indices, values):
            if not state.ON or active() or compiling():
                return wrapped(x, bias, spec, indices, values)
            return direct(unwrap(x), bias if bias is None else unwrap(bias), spec, unwrap(indices), unwrap(values))

        return apply_fixed

    def apply(*args):
        if not state.ON or active() or compiling():
            return wrapped(*args)
        return direct(*[unwrap(a) if isinstance(a, tensor) else a for a in args])

    return apply


def queue_after_backward(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward pass now running finishes (the autograd engine's callback queue);
    False, doing nothing, where the engine offers none."""
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return False
    queue(callback)
    return True


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def graph_task_id():
    """The id of the backward pass (autograd graph task) now running, -1 outside one; None where torch does not
    tell (callers then treat every backward pass as one and the same)."""
    return None if _GRAPH_TASK_ID is None else _GRAPH_TASK_ID()


_MODULE_GLOBALS = torch.nn.modules.module
_GLOBAL_HOOK_TABLES = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called")


def module_hooks_anywhere(module) -> bool:
    """Whether a forward hook could see ``module``'s call: its own hooks, or the global ones of
    ``torch.nn.modules.module`` (private names; where they are missing, True: the caller calls the module)."""
    if module._forward_hooks or module._forward_pre_hooks:
        return True
    try:
        return any(getattr(_MODULE_GLOBALS, name) for name in _GLOBAL_HOOK_TABLES)
    except AttributeError:
        return True


def cuda_raw_stream(device_index: int):
    """The current CUDA stream of a device as the raw handle Triton's compiled launcher takes."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def triton_fast_launch_supported() -> bool:
    """Whether this Triton's launch internals are the ones the kept launches use (the ``JITFunction`` and
    ``CompiledKernel`` entry points, ``triton.knobs``, the raw-stream call): otherwise Triton launches itself."""
    import triton
    from triton.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    return (
        all(hasattr(JITFunction, a) for a in ("run", "__getitem__")) and all(hasattr(CompiledKernel, a) for a in ("run", "_init_handles"))
        and hasattr(torch._C, "_cuda_getCurrentRawStream") and hasattr(triton, "knobs")
    )  # fmt: skip


def triton_device_caches(kernel):
    """A Triton ``JITFunction``'s per-device cache of compiled kernels (what a kept launch reuses), or None
    where this Triton keeps none where we look: launches then go through Triton's own path."""
    return getattr(kernel, "device_caches", None)


def functorch_transforms_active() -> bool:
    """Whether a functorch transform (vmap, grad, jvp) is tracing the current call (False where torch cannot say)."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False
