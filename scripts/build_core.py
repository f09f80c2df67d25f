"""Build the optional compiled core (issue 34): the policy library and the simulator's engine as C
extensions, with mypyc, beside their sources (``scheduler.compiled``).

    python scripts/build_core.py          # build (needs a C compiler and mypy: the test extras)
    python scripts/build_core.py --clean  # remove it: the pure-Python path runs again

The extensions share one runtime library, ``scheduler/compiled_core__mypyc*.so`` (inside the
package, so an editable install and a vLLM process find it like any other module). The build
stamps the digest of the sources it compiled; importing ``scheduler`` refuses a core built from
other sources (``scheduler.compiled.StaleCoreError``). ~45 s on two cores.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GROUP = "scheduler.compiled_core"  # the shared library: scheduler/compiled_core__mypyc*.so


@functools.cache
def _core() -> ModuleType:
    """``scheduler.compiled``, loaded from its file under a bare ``scheduler`` package: importing
    the real package would run the stale check this script exists to fix."""
    import importlib.util

    if "scheduler" not in sys.modules:
        package = ModuleType("scheduler")
        package.__path__ = [str(REPO / "scheduler")]
        sys.modules["scheduler"] = package
    spec = importlib.util.spec_from_file_location(
        "_tailpilot_compiled", REPO / "scheduler" / "compiled.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def clean() -> list[Path]:
    """Remove the extensions, the shared library and the stamp; what was removed."""
    core = _core()
    gone = list(core.extensions(REPO))
    package, library = GROUP.rsplit(".", 1)
    gone += sorted((REPO / package).glob(f"{library}__mypyc*"))
    stamp = REPO / core.STAMP
    if stamp.exists():
        gone.append(stamp)
    for path in gone:
        path.unlink()
    return gone


def _compile_in_parallel(compile: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """A compiler's ``compile`` that compiles each source file on its own, up to one per core at
    a time (distutils compiles one extension's files one after another), the objects in the
    sources' order."""

    def compile_each(sources: list[str], *args: Any, **kwargs: Any) -> list[str]:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            parts = list(pool.map(lambda source: compile([source], *args, **kwargs), sources))
        return [obj for objects in parts for obj in objects]

    return compile_each


def build() -> None:
    from mypyc.build import mypycify
    from setuptools import setup
    from setuptools.command.build_ext import build_ext

    class ParallelBuildExt(build_ext):
        def build_extensions(self) -> None:
            self.compiler.compile = _compile_in_parallel(self.compiler.compile)
            super().build_extensions()

    core = _core()
    clean()
    os.chdir(REPO)
    paths = [str(p.relative_to(REPO)) for p in core.sources(REPO)]
    with tempfile.TemporaryDirectory(prefix="tailpilot-core-") as build_dir:
        # One C file per module (multi_file), compiled side by side: 79 s -> 44 s here for the
        # whole build; both builds in one sitting gave the same replay hashes and the replays'
        # CPU within the noise (mypyc warns multi_file may cost speed: not measurable here). The
        # group's header is written under its package's directory, which mypyc does not put on
        # the include path of the modules' files.
        extensions = mypycify(
            paths, group_name=GROUP, opt_level="3", target_dir=build_dir, multi_file=True
        )
        header_dir = os.path.join(build_dir, *GROUP.split(".")[:-1])
        for extension in extensions:
            extension.include_dirs.append(header_dir)
        setup(
            name="tailpilot-compiled-core",
            ext_modules=extensions,
            cmdclass={"build_ext": ParallelBuildExt},
            script_args=[
                "build_ext",
                "--inplace",
                "--build-temp",
                build_dir,
                "--build-lib",
                build_dir,
            ],
        )
    (REPO / core.STAMP).write_text(core.digest(REPO) + "\n")
    print(f"compiled core: {len(core.extensions(REPO))} modules")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clean", action="store_true", help="remove the compiled core")
    args = ap.parse_args()
    if args.clean:
        gone = clean()
        print(f"removed {len(gone)} files: the pure-Python path runs")
    else:
        build()


if __name__ == "__main__":
    main()
