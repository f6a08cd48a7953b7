"""Serial work items passed to a parallel driver as values, so the driver compiles once.

A blocked kernel's serial work is compiled for its register tiles (kernels/simd/tile.py: a
tile's shape is in its type), and a parallel driver that calls it directly is compiled again
for every tile with it: Numba's parallel loop costs 2-10 s of compile whatever its body holds
(bench/NOTES.md, "Cold compile"), and a CNN uses 4-10 tile shapes (bench/cold_start.py).
Here the work item is compiled on its own (the tiles closed over, _direct_blocked.tile_item),
wrapped in an `Item`, and the driver, typed on the item's signature alone, calls it through
its address:

    run = Item(tile_item(T, T1), sig)           # compiles (or loads) tile_item's function
    conv_direct(L, run, ...)                    # inside: call(run, L, xf, ...)

Numba's own first-class functions (FunctionType) do the same, but unbox each call through
Python (the signature unpickled, two look-ups of addresses: +4 us per call of a small conv,
measured); an Item unboxes as one attribute read.

    call(item, *args)   the compiled function at item.address, on args converted (safely: no
                        narrowing, prange's unsigned index cast first) to item's signature
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.core.typeconv import Conversion
from numba.extending import (
    NativeValue,
    intrinsic,
    models,
    register_model,
    typeof_impl,
    unbox,
)


class ItemType(types.Type):
    """The type of an Item: its signature (its arguments' types, returning None)."""

    def __init__(self, sig):
        self.sig = sig
        super().__init__(name=f"item({', '.join(map(str, sig.args))})")


@register_model(ItemType)
class _ItemModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.IntType(8).as_pointer())  # the function's address


class Item:
    """A jitted function compiled for `sig` (or loaded from Numba's cache), as a value a jitted
    driver calls with `call`. Keeps the dispatcher (and so the machine code) alive."""

    __slots__ = ("_numba_type_", "address", "dispatcher")

    def __init__(self, dispatcher, sig):
        if sig.return_type != types.none:
            raise TypeError(f"a work item returns None, not {sig.return_type}")
        dispatcher.compile(sig)
        cres = dispatcher.overloads[sig.args]
        self.address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
        self._numba_type_ = ItemType(sig)  # typed in C by Numba's dispatcher (as Lanes)
        self.dispatcher = dispatcher

    def __repr__(self):
        return f"Item({self.dispatcher.py_func.__qualname__}, {self._numba_type_.sig})"


@typeof_impl.register(Item)
def _typeof_item(val, c):
    return val._numba_type_


@unbox(ItemType)
def _unbox_item(typ, obj, c):
    address = c.pyapi.object_getattr_string(obj, "address")
    ptr = c.pyapi.long_as_voidptr(address)
    c.pyapi.decref(address)
    return NativeValue(ptr, is_error=c.pyapi.c_api_error())


@intrinsic
def call(typingctx, item, *args):
    """item(*args): a call through the address, in Numba's calling convention (an exception
    raised inside propagates as from any jitted call)."""
    if not isinstance(item, ItemType):
        raise TypingError(f"call: the first argument is an Item, got {item}")
    if len(args) == 1 and isinstance(args[0], types.StarArgTuple):
        args = args[0].types
    want = item.sig.args
    if len(args) != len(want):
        raise TypingError(f"call: {item} takes {len(want)} arguments, got {len(args)}")
    for i, (got, t) in enumerate(zip(args, want, strict=True)):
        conversion = typingctx.can_convert(got, t)
        if conversion is None or conversion > Conversion.safe:
            raise TypingError(f"call: argument {i} is {got}, {item} takes {t}")
    sig = types.none(item, types.StarArgTuple.from_types(args))

    def codegen(context, builder, signature, llargs):
        ptr, packed = llargs
        values = [context.cast(builder, v, got, t)
                  for v, got, t in zip(cgutils.unpack_tuple(builder, packed), args, want,
                                       strict=True)]  # fmt: skip
        fnty = context.call_conv.get_function_type(types.none, want)
        status, _ = context.call_conv.call_function(
            builder, builder.bitcast(ptr, fnty.as_pointer()), types.none, want, values
        )
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return sig, codegen
