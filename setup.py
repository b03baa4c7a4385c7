"""Build tether with its data plane compiled to C by mypyc, or pure Python where it cannot be.

`pip install .` compiles the modules `proxy/compiled.py` lists when a C compiler and Python's
headers are present (mypyc comes with the build dependency `mypy`), and installs them beside
their `.py` source. Where that fails (no compiler, no headers, a mypyc error) it says why, in
one message (pip shows it with `-v`), and installs the pure-Python package: the same code,
only slower. Never a failed install; tether's `tether_started` line says which one runs
(`extensions`; `proxy.compiled.extensions()`).

TETHER_NO_EXTENSIONS at build time: `1` compiles nothing; `0` compiles in an editable install
too, into the checkout (rebuild after each edit: the compiled modules shadow their source).
An editable install is otherwise pure Python, so that what you edit is what runs, and it
removes compiled modules an earlier one left in the checkout.

Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# The shared library of the compiled modules, one top-level module: tether__mypyc.
GROUP_NAME = "tether"


def _load_compiled_module() -> Any:
    """`proxy/compiled.py` (stdlib only), read before anything of tether is installed."""
    spec = importlib.util.spec_from_file_location("_tether_compiled", ROOT / "proxy/compiled.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compiled = _load_compiled_module()


def _say(message: str) -> None:
    print(f"tether: {message}", file=sys.stderr, flush=True)


def _mypyc_extensions() -> list[Any]:
    from mypyc.build import mypycify

    sources = [module.replace(".", "/") + ".py" for module in compiled.COMPILED_MODULES]
    return mypycify(
        [
            *sources,
            # The build environment holds setuptools and mypy, not tether's dependencies:
            # their types are unknown here (Any). mypyc treats their objects as Python
            # objects either way; tether's own types, the ones it compiles to C, are all
            # here. The strict type check with every dependency installed is CI's `mypy`.
            "--ignore-missing-imports",
            "--follow-imports=silent",
        ],
        group_name=GROUP_NAME,
        opt_level="3",
    )


class _BuildExtensions(build_ext):
    """build_ext for the compiled data plane: mypyc generates the C when the build starts
    (not when pip only asks for metadata), and any failure ends in the pure package."""

    editable_mode: bool  # set by setuptools for `pip install -e`

    def finalize_options(self) -> None:
        self._not_compiled = self._why_not_compiled()
        if self._not_compiled is None:
            try:
                self.distribution.ext_modules = _mypyc_extensions()
            except (Exception, SystemExit) as error:  # mypyc reports type errors by exiting
                self._not_compiled = f"mypyc failed: {_describe(error)}"
        super().finalize_options()

    def _why_not_compiled(self) -> str | None:
        switch = os.environ.get(compiled.NO_EXTENSIONS_VARIABLE, "")
        if switch == "1":
            return f"{compiled.NO_EXTENSIONS_VARIABLE}=1"
        if getattr(self, "editable_mode", False) and switch != "0":
            return (
                "an editable install runs the source you edit; "
                f"{compiled.NO_EXTENSIONS_VARIABLE}=0 compiles it in place"
            )
        return _why_no_c_build()

    def run(self) -> None:
        if self._not_compiled is None:
            try:
                super().run()
                _say(f"compiled {len(compiled.COMPILED_MODULES)} modules with mypyc")
                return
            except (Exception, SystemExit) as error:  # no compiler, no headers, a C error
                self._not_compiled = f"the C build failed: {_describe(error)}"
                self.extensions = []
                self.distribution.ext_modules = []
        # No half-compiled package (compiled modules call each other's C directly), and no
        # compiled module of an earlier build in the wheel or, in place, over the source.
        _remove_builds(Path(self.build_lib))
        if getattr(self, "editable_mode", False):
            _remove_builds(ROOT)
        _say(
            f"installing the pure-Python package, not compiled ({self._not_compiled}). "
            "It runs the same code, only slower; to compile, install a C compiler and "
            "Python's headers (Debian: apt-get install gcc python3-dev) and install again."
        )


def _why_no_c_build() -> str | None:
    """What keeps a C extension from building here, found in a moment (before mypyc's
    minute): Python's headers, and a compiler that compiles a file including them."""
    from distutils.ccompiler import new_compiler  # setuptools' own copy of distutils
    from distutils.sysconfig import customize_compiler

    headers = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(headers, "Python.h")):
        return f"Python's headers are missing: no Python.h in {headers}"
    compiler = new_compiler()
    customize_compiler(compiler)
    with tempfile.TemporaryDirectory() as scratch:
        probe = os.path.join(scratch, "probe.c")
        Path(probe).write_text("#include <Python.h>\nint tether_probe(void) { return 0; }\n")
        try:
            compiler.compile([probe], output_dir=scratch, include_dirs=[headers])
        except Exception as error:
            name = compiler.compiler_so[0]  # (a UnixCCompiler: the compiler and its flags)
            # A compiler that ran says why above; one that could not start, here.
            why = _describe(error)
            return f"no working C compiler ({name!r} cannot compile a file including Python.h" + (
                f": {why})" if len(why) < 120 else ")"
            )
    return None


def _remove_builds(root: Path) -> None:
    """The compiled modules (and their shared library) under `root`, if any."""
    for module in (*compiled.COMPILED_MODULES, f"{GROUP_NAME}__mypyc"):
        stem = root / module.replace(".", "/")
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            built = stem.with_name(stem.name + suffix)
            if built.exists():
                built.unlink()
                _say(f"removed {built} (an earlier build)")


def _describe(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return "type errors (above)" if error.code else "stopped"
    return f"{type(error).__name__}: {error}".strip()


class _Distribution(Distribution):
    def has_ext_modules(self) -> bool:
        # The extensions are only known once the build starts (`_BuildExtensions`); until
        # then setuptools must still plan a build_ext and a platform wheel.
        return True


setup(distclass=_Distribution, cmdclass={"build_ext": _BuildExtensions})
