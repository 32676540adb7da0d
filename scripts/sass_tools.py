"""Offline disassembly of a compiled Triton kernel (no GPU needed): the one cuobjdump runner that
scripts/attention_sass.py, fp8_stream_sass.py and int4_mma_sass.py share.

`disassemble(kernel)` runs the cuobjdump bundled with Triton over the kernel's cubin and returns
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
