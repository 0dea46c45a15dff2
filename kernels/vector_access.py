"""Wide (up to 16-byte) loads and stores for the CUDA kernels.

Numba indexes an array one element at a time, so a warp reading a float16 row
issues one 2-byte load per lane per element. On an H200 the first kernels were
bound by the number of load instructions, not by bytes (docs/kernels.md).
These device functions move ``count`` consecutive elements as one vector
access (``ld.v4.u32`` for 16 bytes), which is how CUDA C++ kernels read with
``float4``/``uint4``.

* ``vector_loader(dtype, count)`` → ``load(src, src_index)``: reads ``src``'s
  elements ``src_index .. src_index+count-1`` (flat, row-major; ``src`` must be
  C-contiguous) and returns them widened to float32, as a tuple (index it with
  loop variables of unrolled constant-trip loops, so it stays in registers).
* ``vector_copier(num_bytes)`` → ``copy(dst, dst_index, src, src_index)``:
  copies ``num_bytes`` from ``src`` to ``dst`` (flat element indices, both
  C-contiguous, same dtype) with one load and one store.
* ``vector_storer(dtype, count)`` → ``store(dst, dst_index, values)``: writes
  a tuple of ``count`` float32 values to ``dst``'s elements ``dst_index ..``
  (float16 rounded to nearest even) with one store (``st.global.v4.f32``).
* ``word_loader(dtype, count)`` → ``load(src, src_index)``: the same access
  as ``vector_loader`` but the 16-bit elements stay packed, two to a uint32
  word (a tuple of ``count // 2``), and ``pair_unpacker(dtype)`` →
  ``unpack(word) -> (low, high)`` widens a word's two elements when they are
  used: a kernel holding loads in flight keeps half the registers.

``dtype`` is an element format of ``kernels.element_formats``: float32,
float16, or bfloat16 (whose arrays are int16 bits).

The caller guarantees alignment: the byte address must be a multiple of the
access width (a flat index that is a multiple of ``count`` on an allocation
aligned to 16 bytes, which the caller checks on the host with
``start_alignment``). Under ``NUMBA_ENABLE_CUDASIM=1`` the same functions run as plain
element loops, so the simulator tests cover the kernels' indexing.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
from numba import config, cuda

from kernels.element_formats import STORAGE, _bf16_bits_to_float, format_itemsize

_SIMULATED = bool(config.ENABLE_CUDASIM)  # type: ignore[attr-defined]  # numba.config sets it at import
ACCESS_WIDTHS = (2, 4, 8, 16)
_GLOBAL = 1  # NVVM's global address space: device arrays live there, and `ld.global` skips the generic-address check


def widest_access(num_bytes: int, *, itemsize: int) -> int:
    """The widest access (bytes, ≤ 16) that tiles a run of ``num_bytes`` and holds whole elements."""
    for width in reversed(ACCESS_WIDTHS):
        if width >= itemsize and num_bytes % width == 0:
            return width
    return itemsize


def start_alignment(array) -> int:
    """The widest access (bytes, ≤ 16) that an array's first element is aligned to; views with offsets may
    allow less.

    PyTorch tensors, ``__cuda_array_interface__`` arrays and numpy arrays are
    judged by their own address (a host array is copied to a fresh device
    buffer, so judging it ers narrow: slower, never wrong, and it lets the
    simulator test the narrow paths). The simulator's device arrays expose no
    address; they are fresh allocations, so aligned.
    """
    if hasattr(array, "data_ptr"):
        pointer = array.data_ptr()
    elif hasattr(array, "__cuda_array_interface__"):
        pointer = array.__cuda_array_interface__["data"][0]
    elif isinstance(array, np.ndarray):
        pointer = array.ctypes.data
    else:
        return ACCESS_WIDTHS[-1]
    width = ACCESS_WIDTHS[-1]
    while width > 1 and pointer % width:
        width //= 2
    return width


@functools.cache
def vector_loader(dtype: str, count: int):
    """A device function loading ``count`` elements of ``dtype`` (float32/float16/bfloat16) as float32, in one access."""
    itemsize = format_itemsize(dtype)
    if count * itemsize not in ACCESS_WIDTHS:
        raise ValueError(f"{count} x {dtype} is {count * itemsize} bytes; accesses are {ACCESS_WIDTHS} bytes")
    if _SIMULATED:
        widen = _bf16_bits_to_float if dtype == "bfloat16" else np.float32

        @cuda.jit(device=True)
        def load(src, src_index):
            flat = src.reshape(-1)
            return tuple(widen(flat[src_index + i]) for i in range(count))

        return load
    return _load_intrinsic(dtype, count)


@functools.cache
def word_loader(dtype: str, count: int):
    """A device function loading ``count`` 16-bit elements (float16/bfloat16) packed two to a uint32, in one access."""
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"packed loads are for 16-bit formats; got {dtype}")
    if count * 2 not in ACCESS_WIDTHS or count < 2:
        raise ValueError(f"{count} x {dtype} is {count * 2} bytes; packed accesses are 4, 8 or 16 bytes")
    if _SIMULATED:

        @cuda.jit(device=True)
        def load(src, src_index):
            flat = src.reshape(-1)
            return tuple(np.uint32(int(np.asarray(flat[src_index + 2 * w]).view(np.uint16))
                                   | (int(np.asarray(flat[src_index + 2 * w + 1]).view(np.uint16)) << 16))
                         for w in range(count // 2))

        return load
    return _word_load_intrinsic(dtype, count)


@functools.cache
def pair_unpacker(dtype: str):
    """A device function widening a uint32 word of two float16/bfloat16 elements to (low, high) float32."""
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"packed words hold 16-bit formats; got {dtype}")
    if _SIMULATED:
        if dtype == "float16":
            def widen(bits):
                return np.float32(np.array([bits], np.uint16).view(np.float16)[0])
        else:
            def widen(bits):
                return _bf16_bits_to_float(np.array([bits], np.uint16).view(np.int16)[0])

        @cuda.jit(device=True)
        def unpack(word):
            value = int(word)
            return widen(value & 0xFFFF), widen(value >> 16)

        return unpack
    return _unpack_intrinsic(dtype)


@functools.cache
def vector_copier(num_bytes: int):
    """A device function copying ``num_bytes`` (2, 4, 8 or 16) between arrays of one dtype, in one access."""
    if num_bytes not in ACCESS_WIDTHS:
        raise ValueError(f"copies are {ACCESS_WIDTHS} bytes; got {num_bytes}")
    if _SIMULATED:

        @cuda.jit(device=True)
        def copy(dst, dst_index, src, src_index):
            count = num_bytes // src.dtype.itemsize
            dst_flat, src_flat = dst.reshape(-1), src.reshape(-1)
            for i in range(count):
                dst_flat[dst_index + i] = src_flat[src_index + i]

        return copy
    return _copy_intrinsic(num_bytes)


# -- real GPU: LLVM IR through Numba intrinsics ------------------------------------------------


def _types_of(numba_type):
    """The types module that made an argument's type: numba-cuda may carry its own copy of numba's."""
    return importlib.import_module(type(numba_type).__module__.rsplit(".", 1)[0])


def _is_array(numba_type, dtype: str | None = None) -> bool:
    return hasattr(numba_type, "ndim") and hasattr(numba_type, "dtype") and (
        dtype is None or str(numba_type.dtype) == dtype)


def _address(builder, array_value, index, itemsize: int, ir):
    """The address of flat element ``index`` of an array argument (Numba's array ABI: field 4 is the data pointer)."""
    data = builder.extract_value(array_value, 4)
    base = builder.ptrtoint(data, ir.IntType(64))
    offset = builder.mul(builder.sext(index, ir.IntType(64)) if index.type.width < 64 else index,
                         ir.Constant(ir.IntType(64), itemsize))
    return builder.add(base, offset)


def _word_vector(num_bytes: int, ir):
    """The LLVM type moved for ``num_bytes``: i16, i32, or a vector of i32."""
    if num_bytes == 2:
        return ir.IntType(16)
    if num_bytes == 4:
        return ir.IntType(32)
    return ir.VectorType(ir.IntType(32), num_bytes // 4)


def _load(builder, address, typ, align: int, ir):
    pointer = builder.inttoptr(address, typ.as_pointer(_GLOBAL))
    try:
        loaded = builder.load(pointer, align=align, typ=typ)
    except TypeError:  # llvmlite without the `typ` argument (typed pointers)
        loaded = builder.load(pointer, align=align)
    return loaded


def _half_as_float(builder, half_bits, dtype: str, ir):
    """One 16-bit element (an i16) widened to float32: float16 by conversion, bfloat16 by a shift."""
    if dtype == "bfloat16":
        wide = builder.shl(builder.zext(half_bits, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return builder.fpext(builder.bitcast(half_bits, ir.HalfType()), ir.FloatType())


def _words_as_floats(builder, loaded, dtype: str, count: int, ir):
    """Split loaded words into ``count`` float32 values (16-bit elements widened)."""
    words = [loaded] if not isinstance(loaded.type, ir.VectorType) else [
        builder.extract_element(loaded, ir.Constant(ir.IntType(32), i)) for i in range(loaded.type.count)]
    values = []
    for word in words:
        if dtype == "float32":
            values.append(builder.bitcast(word, ir.FloatType()))
            continue
        halves = [word] if word.type.width == 16 else [
            builder.trunc(word, ir.IntType(16)),
            builder.trunc(builder.lshr(word, ir.Constant(ir.IntType(32), 16)), ir.IntType(16)),
        ]
        for half_bits in halves:
            values.append(_half_as_float(builder, half_bits, dtype, ir))
    assert len(values) == count
    return values


def _load_intrinsic(dtype: str, count: int):
    from llvmlite import ir  # type: ignore[import-untyped]  # no stubs; only the real GPU path builds IR
    from numba.cuda.extending import intrinsic

    itemsize = format_itemsize(dtype)
    num_bytes = count * itemsize

    @intrinsic
    def load(typingctx, src, src_index):
        if not (_is_array(src, STORAGE[dtype]) and str(src_index).startswith(("int", "uint"))):
            return None
        typ = _types_of(src)
        sig = typ.UniTuple(typ.float32, count)(src, src_index)

        def codegen(context, builder, signature, args):
            src_value, index_value = args
            loaded = _load(builder, _address(builder, src_value, index_value, itemsize, ir),
                           _word_vector(num_bytes, ir), num_bytes, ir)
            values = _words_as_floats(builder, loaded, dtype, count, ir)
            return context.make_tuple(builder, signature.return_type, values)

        return sig, codegen

    return load


def _word_load_intrinsic(dtype: str, count: int):
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    num_bytes = count * 2
    num_words = num_bytes // 4

    @intrinsic
    def load(typingctx, src, src_index):
        if not (_is_array(src, STORAGE[dtype]) and str(src_index).startswith(("int", "uint"))):
            return None
        typ = _types_of(src)
        sig = typ.UniTuple(typ.uint32, num_words)(src, src_index)

        def codegen(context, builder, signature, args):
            src_value, index_value = args
            loaded = _load(builder, _address(builder, src_value, index_value, 2, ir), _word_vector(num_bytes, ir),
                           num_bytes, ir)
            words = [loaded] if num_words == 1 else [
                builder.extract_element(loaded, ir.Constant(ir.IntType(32), i)) for i in range(num_words)]
            return context.make_tuple(builder, signature.return_type, words)

        return sig, codegen

    return load


def _unpack_intrinsic(dtype: str):
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def unpack(typingctx, word):
        if str(word) != "uint32":
            return None
        typ = _types_of(word)
        sig = typ.UniTuple(typ.float32, 2)(word)

        def codegen(context, builder, signature, args):
            (value,) = args
            low = builder.trunc(value, ir.IntType(16))
            high = builder.trunc(builder.lshr(value, ir.Constant(ir.IntType(32), 16)), ir.IntType(16))
            if dtype == "bfloat16":  # the high element needs no shift: mask the low one away
                high_value = builder.bitcast(builder.and_(value, ir.Constant(ir.IntType(32), 0xFFFF0000)),
                                             ir.FloatType())
            else:
                high_value = _half_as_float(builder, high, dtype, ir)
            return context.make_tuple(builder, signature.return_type,
                                      [_half_as_float(builder, low, dtype, ir), high_value])

        return sig, codegen

    return unpack


def _copy_intrinsic(num_bytes: int):
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def copy(typingctx, dst, dst_index, src, src_index):
        if not (_is_array(dst) and _is_array(src, str(dst.dtype))):
            return None
        sig = _types_of(src).void(dst, dst_index, src, src_index)
        itemsize = src.dtype.bitwidth // 8

        def codegen(context, builder, signature, args):
            dst_value, dst_index_value, src_value, src_index_value = args
            typ = _word_vector(num_bytes, ir)
            loaded = _load(builder, _address(builder, src_value, src_index_value, itemsize, ir), typ, num_bytes, ir)
            target = builder.inttoptr(_address(builder, dst_value, dst_index_value, itemsize, ir), typ.as_pointer(_GLOBAL))
            builder.store(loaded, target, align=num_bytes)
            return context.get_dummy_value()

        return sig, codegen

    return copy


@functools.cache
def vector_storer(dtype: str, count: int):
    """A device function storing ``count`` float32 values into ``dtype`` (float32/float16) elements, in one access.

    ``store(dst, dst_index, values)`` writes the tuple ``values`` to ``dst``'s
    flat elements ``dst_index .. dst_index+count-1``; float16 rounds to nearest
    even, like an element assignment.
    """
    itemsize = np.dtype(dtype).itemsize
    if count * itemsize not in ACCESS_WIDTHS:
        raise ValueError(f"{count} x {dtype} is {count * itemsize} bytes; accesses are {ACCESS_WIDTHS} bytes")
    if _SIMULATED:

        @cuda.jit(device=True)
        def store(dst, dst_index, values):
            flat = dst.reshape(-1)
            for i in range(count):
                flat[dst_index + i] = values[i]

        return store
    return _store_intrinsic(dtype, count)


def _store_intrinsic(dtype: str, count: int):
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    itemsize = np.dtype(dtype).itemsize
    num_bytes = count * itemsize

    @intrinsic
    def store(typingctx, dst, dst_index, values):
        if not (_is_array(dst, dtype) and str(dst_index).startswith(("int", "uint"))
                and getattr(values, "count", None) == count and str(getattr(values, "dtype", "")).startswith("float")):
            return None
        typ = _types_of(dst)
        sig = typ.void(dst, dst_index, values)

        def codegen(context, builder, signature, args):
            dst_value, index_value, values_value = args
            element = ir.FloatType() if dtype == "float32" else ir.HalfType()
            vector = ir.Constant(ir.VectorType(element, count), None) if count > 1 else None
            for i in range(count):
                value = context.cast(builder, builder.extract_value(values_value, i), values.dtype, typ.float32)
                if dtype == "float16":
                    value = builder.fptrunc(value, ir.HalfType())  # round to nearest even (cvt.rn.f16.f32)
                vector = value if vector is None else builder.insert_element(vector, value, ir.Constant(ir.IntType(32), i))
            pointer = builder.inttoptr(_address(builder, dst_value, index_value, itemsize, ir),
                                       vector.type.as_pointer(_GLOBAL))
            builder.store(vector, pointer, align=num_bytes)
            return context.get_dummy_value()

        return sig, codegen

    return store
