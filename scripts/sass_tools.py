"""Offline disassembly of a compiled Triton kernel (no GPU needed): the one cuobjdump runner that
scripts/attention_sass.py, fp8_stream_sass.py and int4_mma_sass.py share.

`compile_sm90(fn, const, ptrs, ...)` compiles a @triton.jit kernel for sm_90 without a GPU, every
argument typed from its name (constexpr, a pointer 16-byte aligned, a float, else i32 with
`aligned` ones divisible by 16). `disassemble(kernel)` runs the cuobjdump bundled with Triton over the kernel's cubin and returns
its resource figures (registers, stack bytes, shared bytes) and its SASS text; `opcodes(sass)`
lists the opcode of every instruction in program order (with modifiers, e.g.
"LDG.E.128.CONSTANT"), predicates stripped.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

# one SASS instruction line: "/*0123*/  @!P0 LDG.E.128 R4, ..." -> "LDG.E.128"
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_.]+)", flags=re.M)


def compile_sm90(fn, const: dict, ptrs: dict, aligned=(), floats=(), **options):
    """`triton.compile` of `fn` for sm_90: `const` its constexprs, `ptrs` its pointers' element types
    (e.g. "bf16", "fp8e4nv"), `floats` its fp32 scalars, `options` num_warps / num_stages / ..."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name], attrs[(i,)] = "*" + ptrs[name], [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def opcodes(sass: str) -> list[str]:
    return _INSTRUCTION.findall(sass)


def disassemble(kernel) -> tuple[dict, str]:
    """(reg / stack / shared_bytes figures, SASS text) of a `triton.compile` result."""
    import triton
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    fig = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", usage)}
    fig["shared_bytes"] = kernel.metadata.shared
    return fig, sass
