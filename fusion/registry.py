"""The default catalog, and registering patterns and kernels from user code, plugins and
installed packages.

    import fusion
    from fusion import Const, Var, op

    @fusion.register_pattern(
        "GemmRelu",
        op.Relu(op.Gemm(Var("x", dtype="float32"), Const("W"), Const("b"), transB=1)),
        inputs=("x", "W", "b"),
    )
    def gemm_relu(x, W, b, **attrs):
        return np.maximum(x @ W.T + b, 0)

A kernel is either a plain function `kernel(*inputs, **attributes) -> array or tuple`, or,
for kernels that prepare constant inputs once (packing weights), a factory
`prepare(attributes, constants) -> run(*inputs) -> tuple`. Registered rules join the built-in
catalog in `fusion.rewrite`, `fusion.Session` and the CLI; a third-party package can ship a
catalog under the entry point group `fusion.catalogs` (a Catalog, a list of Rules, or a
function returning either).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import fusion_patterns
from fusion.catalog import Catalog, Rule
from fusion.errors import CatalogError, FusionError

ENTRY_POINT_GROUP = "fusion.catalogs"
USER = Catalog()  # rules registered by user code in this process


def default_catalog() -> Catalog:
    """The built-in catalog (patterns/), catalogs installed under the entry point group
    `fusion.catalogs`, and rules registered in this process with `fusion.register_pattern`."""
    return Catalog([*fusion_patterns.RULES, *installed_catalogs(), *USER.ordered()])


def register_pattern(
    name: str,
    pattern,
    *,
    inputs,
    kernel: Callable | None = None,
    prepare: Callable | None = None,
    catalog: Catalog | None = None,
    **options,
):
    """Add a rule to `catalog` (default: the user catalog that joins the built-in one).

    Give `kernel` (plain function), or `prepare` (factory), or neither to get a decorator
    that takes the kernel function; either way the rule holds a factory (Rule.prepare). Other
    options are Rule's: outputs, attributes, check, priority, description, rtol, atol, accumulates,
    explain_after.
    """
    if kernel is None and prepare is None:
        Rule(name, pattern, inputs=inputs, **options)  # report pattern errors at once

        def decorate(fn: Callable) -> Callable:
            register_pattern(name, pattern, inputs=inputs, kernel=fn, catalog=catalog, **options)
            return fn

        return decorate
    if kernel is not None and prepare is not None:
        raise CatalogError(f"rule {name!r}: give a kernel or a prepare factory, not both")
    if kernel is not None:
        _require_arity(name, kernel, len(tuple(inputs)))
        factory = _plain_kernel(kernel)
    else:
        _require_factory_signature(name, prepare)
        factory = prepare
    rule = Rule(name, pattern, inputs=inputs, prepare=factory, **options)
    target = USER if catalog is None else catalog
    if catalog is None and rule.name in _builtin_names():
        raise CatalogError(f"a rule named {rule.name!r} is already in the built-in catalog")
    return target.add(rule)


def _plain_kernel(fn: Callable) -> Callable:
    """The factory of a plain kernel: attributes become its keyword arguments."""

    def factory(attrs: dict, constants: list) -> Callable:
        def run(*inputs):
            out = fn(*inputs, **attrs)
            return out if isinstance(out, tuple) else (out,)

        return run

    factory.__module__, factory.__qualname__ = fn.__module__, fn.__qualname__
    factory.plain_kernel = fn
    return factory


def _require_arity(name: str, fn: Callable, n_inputs: int) -> None:
    try:
        inspect.signature(fn).bind(*([None] * n_inputs))
    except TypeError as exc:
        raise CatalogError(
            f"rule {name!r}: kernel {fn.__qualname__} cannot take the pattern's "
            f"{n_inputs} inputs positionally ({exc})"
        ) from None
    except ValueError:  # builtins without a signature: accept
        pass


def _require_factory_signature(name: str, fn: Callable) -> None:
    try:
        inspect.signature(fn).bind({}, [])
    except TypeError as exc:
        raise CatalogError(
            f"rule {name!r}: prepare must be called as prepare(attributes, constants) ({exc})"
        ) from None


def _builtin_names() -> set[str]:
    return {rule.name for rule in fusion_patterns.RULES}


@functools.cache
def installed_catalogs() -> tuple[Rule, ...]:
    """Rules from packages that declare an entry point in the group `fusion.catalogs`."""
    rules: list[Rule] = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            found = ep.load()
            found = found() if callable(found) and not isinstance(found, Catalog) else found
        except Exception as exc:
            raise FusionError(f"catalog entry point {ep.name!r} failed to load: {exc}") from None
        rules.extend(found)
    return tuple(rules)


def load_plugin(path: str | Path) -> None:
    """Import a Python file whose top level registers patterns (the CLI's --plugin)."""
    path = Path(path)
    if path.is_dir():
        raise FusionError(f"plugin {path}: is a directory, not a Python file")
    if not path.exists():
        raise FusionError(f"plugin {path}: no such file")
    if not path.is_file():
        raise FusionError(f"plugin {path}: not a regular file")
    if path.resolve() in _LOADED:
        return
    module_name = f"fusion_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except CatalogError as exc:
        raise FusionError(f"plugin {path}: {exc}") from None
    except Exception as exc:
        raise FusionError(f"plugin {path} failed: {type(exc).__name__}: {exc}") from None
    _LOADED.add(path.resolve())


def loaded_plugins() -> list[Path]:
    """The plugin files this process has loaded (files a command reads: never to overwrite)."""
    return sorted(_LOADED)


_LOADED: set[Path] = set()
