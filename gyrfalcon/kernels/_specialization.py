"""The specialization Triton compiles a JIT launch for, computed for an interpreted launch (no GPU needed).

Triton keys each compiled variant on the launch's constexprs (by value) and, for the other arguments, on a
pointer's 16-byte alignment or an integer being 1 or a multiple of 16 (unless the kernel declares them
do_not_specialize). tests/runner/test_jit_specialization.py checks that eager steps compile once across batch
shapes; benchmarks/startup_compiles.py counts the variants a GPU startup compiles. Dev tooling: it reads
Triton internals (native_specialize_impl), which a different Triton may not have.
"""

from __future__ import annotations

import inspect


def launch_signature(jit, args, kwargs) -> tuple:
    """((name, "tl.constexpr", value) for a declared constexpr, (name, type name) for a do_not_specialize
    argument, (name, *Triton's key) for the rest) of launching the InterpretedFunction `jit` with these
    positional and keyword arguments (launch options such as num_warps are not part of it)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    bound = dict(zip(jit.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in jit.arg_names})
    dns = set(jit.kwargs.get("do_not_specialize") or ())
    dnsoa = set(jit.kwargs.get("do_not_specialize_on_alignment") or ())
    sig = []
    for name, p in inspect.signature(jit.fn).parameters.items():
        if name not in bound:
            continue
        v = bound[name]
        if "constexpr" in str(p.annotation):
            sig.append((name, "tl.constexpr", v))  # a declared constexpr (an int equal to 1 reads "constexpr")
        elif name in dns:
            sig.append((name, type(v).__name__))
        else:
            sig.append((name,) + tuple(native_specialize_impl(BaseBackend, v, False, True, name not in dnsoa)))
    return tuple(sig)
