"""A cheap host-side launch path for fkv's Triton kernels.

``kernel[grid](*args)`` makes Triton bind, type and specialize every argument and look the variant
up in its cache on every call: tens of µs of Python per launch on a slow host, more than a
decode-sized kernel runs on the GPU. fkv's launchers know which arguments change from call to call
(the tensors, the token count) and which are fixed for a given input signature (strides, sizes,
constexprs, ``num_warps``). A :class:`LaunchSite` holds the fixed ones; after one normal launch per
*specialization key* of the per-call ones it keeps the compiled variant and calls Triton's compiled
launcher directly, skipping the binder.

The kernel's parameters must list the per-call ones first (:class:`KernelLauncher` checks this), so
a launch is ``run(grid, stream, ..., *per_call, *fixed)`` with no reordering.

**Specialization key.** Finer than or equal to Triton's own, so a cached variant is always the one
Triton would pick for the same arguments: the current CUDA device; per pointer argument its
address modulo 16; per scalar argument its Python type (an int and a float of equal value are
typed i32 and fp32 by Triton), whether it fits in int32 and in int64 (Triton types an int i32,
i64 or u64 by its range) and, unless the kernel marks it
``do_not_specialize``, whether it equals 1 and whether 16 divides it. The rest is the site owner's
contract: a site is made per input signature, which must include the dtype of every pointer
argument (Triton types pointers by dtype) besides the fixed values themselves.

**Triton internals used** (the ``CompiledKernel`` calling convention of Triton 3.3 to 3.9):
``kernel[grid](...)`` returns the ``CompiledKernel``; ``compiled.run(gx, gy, gz, stream,
compiled.function, compiled.packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` with
``args`` every bound argument in parameter order, constexprs included (as ``JITFunction.run``
passes them). Anything that does not match falls back to the normal launch for good:

- ``FKV_FAST_LAUNCH=0`` in the environment (or :data:`ENABLED` set False) -- always normal;
- the CPU interpreter (``TRITON_INTERPRET=1``: the kernel is not a ``JITFunction``) -- normal;
- a Triton launch-enter hook installed (profilers) -- normal while it is installed;
- a compiled object without ``run``/``function``/``packed_metadata``, or a first direct call that
  raises ``TypeError`` (another calling convention) -- normal, and the fast path is turned off.

What is skipped compared with ``JITFunction.run``: its pre-run hooks (fkv kernels have none), the
check that global values the kernel read have not changed (fkv kernels read only constants), and
re-reading ``TRITON_DEBUG``-style knobs per call (a variant compiled before such a knob changed
keeps being used).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import triton

from fkv.errors import FkvError

__all__ = ["ENABLED", "KernelLauncher", "LaunchSite", "check_kernel_device", "pdl_capable"]

#: Master switch of the direct-launch path (``FKV_FAST_LAUNCH=0`` turns it off at import).
ENABLED: bool = os.environ.get("FKV_FAST_LAUNCH", "1").strip().lower() not in ("0", "false",
                                                                                "no", "off")

_I32_MIN, _I32_MAX = -(2 ** 31), 2 ** 31 - 1
_I64_MAX = 2 ** 63 - 1


class _Runtime:
    """Triton's current-device/stream getters and launch knobs, resolved once (after the first
    normal launch, so CUDA is initialized)."""

    def __init__(self) -> None:
        self.ready = False
        self.get_device: Any = None
        self.get_stream: Any = None
        self.knobs: Any = None

    def resolve(self) -> bool:
        """Resolve the getters; False if this Triton lacks what the direct path uses."""
        if not self.ready:
            try:
                driver = triton.runtime.driver.active
                self.get_device = driver.get_current_device
                self.get_stream = driver.get_current_stream
                self.knobs = triton.knobs.runtime
            except (AttributeError, RuntimeError):
                return False
            # torch.cuda.current_device() is _lazy_init() + this C call; CUDA is initialized by now
            torch = sys.modules.get("torch")
            raw = getattr(getattr(torch, "_C", None), "_cuda_getDevice", None)
            if raw is not None and self.get_device is getattr(torch.cuda, "current_device", None):
                self.get_device = raw
            self.ready = True
        return True


_RUNTIME = _Runtime()


class KernelLauncher:
    """One ``@triton.jit`` kernel whose first parameters (``per_call``) change between calls.

    ``pointers``: the leading per-call parameters that take tensors; the other per-call parameters
    take Python scalars (int, float, bool). Everything after them is fixed per
    :class:`LaunchSite`.
    """

    def __init__(self, kernel: Any, per_call: Sequence[str], pointers: Sequence[str]) -> None:
        names = tuple(getattr(kernel, "arg_names", ()))
        per_call, pointers = tuple(per_call), tuple(pointers)
        if names[:len(per_call)] != per_call or per_call[:len(pointers)] != pointers:
            raise FkvError(f"KernelLauncher: the kernel's parameters {names} must start with the "
                           f"per-call ones {per_call}, which must start with the pointers "
                           f"{pointers}")
        self.kernel = kernel
        self.per_call = per_call
        self.fixed_names = names[len(per_call):]
        self.num_pointers = len(pointers)
        params = {p.name: p for p in getattr(kernel, "params", ())}
        ints = [(i, not getattr(params.get(n), "do_not_specialize", False))
                for i, n in enumerate(per_call) if i >= len(pointers)]
        self._int_spec = tuple(i for i, spec in ints if spec)
        self._int_plain = tuple(i for i, spec in ints if not spec)
        self.compiles = compiles(kernel)

    def site(self, fixed: Mapping[str, Any], options: Mapping[str, Any] | None = None) -> LaunchSite:
        """A launch site for these fixed arguments (every parameter after the per-call ones) and
        launch options (``num_warps``...)."""
        missing = [n for n in self.fixed_names if n not in fixed]
        extra = [n for n in fixed if n not in self.fixed_names]
        if missing or extra:
            raise FkvError(f"KernelLauncher.site: fixed arguments missing {missing}, unknown {extra}")
        return LaunchSite(self, tuple(fixed[n] for n in self.fixed_names), dict(options or {}))

    def key(self, device: int, pointers: Sequence[int], args: tuple) -> tuple:
        """The specialization key (see the module docstring): ``pointers`` are the addresses of
        the pointer arguments, ``args`` all per-call arguments."""
        align = 0
        for p in pointers:
            align = (align << 4) | (p & 15)
        ints = []
        for i in self._int_spec:
            v = args[i]
            ints.append((type(v), _I32_MIN <= v <= _I32_MAX, v <= _I64_MAX, v == 1, v % 16 == 0))
        for i in self._int_plain:
            v = args[i]
            ints.append((type(v), _I32_MIN <= v <= _I32_MAX, v <= _I64_MAX))
        return device, align, tuple(ints)


class LaunchSite:
    """Launches of one kernel with one set of fixed arguments; caches compiled variants by key.

    Direct launches pass the pointer arguments as integer addresses (``data_ptr()``, read once for
    the key anyway): Triton's launcher then skips its per-pointer attribute call and driver query.
    The site owner's signature already pins every tensor's device (a CPU tensor never gets here).
    """

    __slots__ = ("launcher", "fixed", "options", "variants", "direct_launches")

    def __init__(self, launcher: KernelLauncher, fixed: tuple, options: dict[str, Any]) -> None:
        self.launcher = launcher
        self.fixed = fixed
        self.options = options
        # key -> (run, function, packed_metadata, the CompiledKernel: kept alive so its module is
        # never unloaded under us); None: this site always launches normally
        self.variants: dict[tuple, tuple] | None = {} if launcher.compiles else None
        self.direct_launches = 0  # launches that skipped Triton's binder (tests read it)

    def normal(self, grid: tuple[int, ...], args: tuple) -> Any:
        """Triton's own launch (binds and specializes every argument); returns what it returns."""
        return self.launcher.kernel[grid](*args, *self.fixed, **self.options)

    def __call__(self, grid: tuple[int, int, int], args: tuple,
                 pointers: list[int] | None = None) -> None:
        """Launch on ``grid`` with the per-call ``args`` (in parameter order). ``pointers``: the
        addresses of the pointer arguments when the caller read them already (a prepared launch
        repeated many times); ``args`` must hold the tensors at those addresses (the normal
        launch binds them)."""
        variants = self.variants
        rt = _RUNTIME
        if variants is None or not ENABLED:
            self.normal(grid, args)
            return
        if not rt.ready:  # the process's first compiled launch: it initializes what rt resolves
            compiled = self.normal(grid, args)
            if not rt.resolve():
                self.variants = None
                return
            if pointers is None:
                pointers = [a.data_ptr() for a in args[:self.launcher.num_pointers]]
            self._keep(compiled, self.launcher.key(rt.get_device(), pointers, args))
            return
        knobs = rt.knobs
        enter = knobs.launch_enter_hook
        if enter is not None and getattr(enter, "calls", True):  # 3.9: an empty HookChain is off
            self.normal(grid, args)  # a profiler's hook: Triton builds the metadata it expects
            return
        launcher = self.launcher
        n = launcher.num_pointers
        if pointers is None:
            pointers = [a.data_ptr() for a in args[:n]]
        device = rt.get_device()
        key = launcher.key(device, pointers, args)
        entry = variants.get(key)
        if entry is None:
            self._first(grid, args, key)
            return
        run, function, packed, _ = entry
        try:
            run(grid[0], grid[1], grid[2], rt.get_stream(device), function, packed, None, enter,
                knobs.launch_exit_hook, *pointers, *args[n:], *self.fixed)
        except TypeError:  # arguments rejected before launching: another calling convention
            self.variants = None
            self.normal(grid, args)
            return
        self.direct_launches += 1

    def _first(self, grid: tuple[int, int, int], args: tuple, key: tuple) -> None:
        """Normal launch for a new key; keep what it compiled for the direct path."""
        self._keep(self.normal(grid, args), key)

    def _keep(self, compiled: Any, key: tuple) -> None:
        """Keep the variant a normal launch returned under ``key``, or (not the CompiledKernel
        this module knows) launch normally from now on."""
        try:
            entry = (compiled.run, compiled.function, compiled.packed_metadata, compiled)
        except AttributeError:
            entry = None
        if entry is None or entry[1] is None or not callable(entry[0]):
            self.variants = None  # not the CompiledKernel this module knows: normal from now on
            return
        self.variants[key] = entry  # type: ignore[index]


def compiles(kernel: Any) -> bool:
    """Whether ``kernel`` is compiled by Triton for a GPU (not the CPU interpreter's function)."""
    return isinstance(kernel, triton.runtime.jit.JITFunction)


def check_kernel_device(device: Any, kernel: Any, field: str, op: str) -> None:
    """Raise FkvError when a compiled Triton ``kernel`` would be given tensors that are not on
    CUDA (``field`` is on ``device``): Triton itself would fail with a RuntimeError about its
    drivers, or about a CPU pointer, which says nothing of the fix."""
    if getattr(device, "type", None) != "cuda" and compiles(kernel):
        raise FkvError(f"{field!r} is on {device}: the Triton kernel runs on CUDA tensors, or on "
                       f"CPU with TRITON_INTERPRET=1 set before triton is imported; or use "
                       f"fkv.ops.reference.{op}")


def pdl_capable(device: Any) -> bool:
    """Whether compiled Triton kernels on ``device`` can be launched with programmatic dependent
    launch (CUDA, compute capability 9.0 or newer)."""
    capability = cuda_capability(device)
    return capability is not None and capability[0] >= 9


def cuda_capability(device: Any) -> tuple[int, int] | None:
    """``(major, minor)`` compute capability of a CUDA ``device`` (cached per device), None for
    any other device."""
    if getattr(device, "type", None) != "cuda":
        return None
    index = device.index
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return _capability(index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return major, minor
