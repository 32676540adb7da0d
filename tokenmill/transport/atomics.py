"""Acquire loads and release stores on a shared-memory mapping, for the broadcast ring.

Python has no memory-ordering primitives, so these call GCC's libatomic (`__atomic_load_N` /
`__atomic_store_N` with an explicit memory order) through ctypes: correct on any CPU. Where
libatomic is missing, x86-64 alone is accepted with plain loads and stores, because its
total store order already gives every load acquire and every store release semantics (and each
access here is a separate C call that no compiler reorders); other CPUs are refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform
import struct

_ACQUIRE, _RELEASE = 2, 3  # __ATOMIC_ACQUIRE, __ATOMIC_RELEASE
_U64 = struct.Struct("<Q")


def _load_libatomic():
    name = ctypes.util.find_library("atomic")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    load8, store8 = lib.__atomic_load_8, lib.__atomic_store_8
    load8.argtypes, load8.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
    store8.argtypes, store8.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int], None
    load1, store1 = lib.__atomic_load_1, lib.__atomic_store_1
    load1.argtypes, load1.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint8
    store1.argtypes, store1.restype = [ctypes.c_void_p, ctypes.c_uint8, ctypes.c_int], None
    return load8, store8, load1, store1


class SharedAtomics:
    """Ordered accesses at byte offsets of one mapping. Call `release()` before closing the map."""

    def __init__(self, mm: mmap.mmap, force_plain: bool = False) -> None:
        self._mm = mm
        funcs = None if force_plain else _load_libatomic()
        if funcs is None and platform.machine().lower() not in ("x86_64", "amd64"):
            raise RuntimeError(f"the shared-memory ring needs libatomic on {platform.machine()} "
                               f"(install the gcc runtime's libatomic1)")
        self._anchor = ctypes.c_char.from_buffer(mm) if funcs is not None else None
        self._base = ctypes.addressof(self._anchor) if funcs is not None else 0
        self._funcs = funcs

    @property
    def ordered_by_libatomic(self) -> bool:
        return self._funcs is not None

    def load_u64_acquire(self, offset: int) -> int:
        if self._funcs is None:
            return _U64.unpack_from(self._mm, offset)[0]
        return self._funcs[0](self._base + offset, _ACQUIRE)

    def store_u64_release(self, offset: int, value: int) -> None:
        if self._funcs is None:
            _U64.pack_into(self._mm, offset, value)
        else:
            self._funcs[1](self._base + offset, value, _RELEASE)

    def all_set_acquire(self, offset: int, count: int) -> bool:
        """Whether `count` flag bytes from `offset` are all 1."""
        if self._funcs is None:
            return self._mm[offset:offset + count] == b"\x01" * count
        load1 = self._funcs[2]
        return all(load1(self._base + offset + i, _ACQUIRE) == 1 for i in range(count))

    def store_u8_release(self, offset: int, value: int) -> None:
        if self._funcs is None:
            self._mm[offset] = value
        else:
            self._funcs[3](self._base + offset, value, _RELEASE)

    def release(self) -> None:
        """Drop the exported pointer so the mapping can be closed."""
        self._anchor = None
        self._funcs = None
