"""Builds the kvxfer wheel: cargo builds libkvxfer.so from the crate one directory up,
and the wheel carries it inside the package, so an installed wheel needs no compiler.

The bindings are ctypes (no Python extension module), so the wheel is tagged
``py3-none-<platform>``: one wheel per platform, any CPython 3.

    KVXFER_SOURCE_DIR   the crate's directory (default: the parent of this one)
    KVXFER_PREBUILT     a libkvxfer.so to bundle instead of running cargo
    CARGO               the cargo to run (default: cargo on PATH, then ~/.cargo/bin/cargo)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent


def source_dir() -> Path:
    root = Path(os.environ.get("KVXFER_SOURCE_DIR", HERE.parent)).resolve()
    manifest = root / "Cargo.toml"
    if not manifest.is_file() or 'name = "kvxfer"' not in manifest.read_text():
        raise SystemExit(
            f"kvxfer: no kvxfer crate at {root}: build from a checkout "
            "(`pip install ./python`) or set KVXFER_SOURCE_DIR / KVXFER_PREBUILT"
        )
    return root


def crate_version() -> str:
    text = (source_dir() / "Cargo.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def cargo() -> str:
    if os.environ.get("CARGO"):
        return os.environ["CARGO"]
    found = shutil.which("cargo")
    if found:
        return found
    home = Path.home() / ".cargo" / "bin" / "cargo"
    if home.is_file():
        return str(home)
    raise SystemExit("kvxfer: cargo not found (install Rust with rustup, or set CARGO)")


def build_library() -> Path:
    prebuilt = os.environ.get("KVXFER_PREBUILT")
    if prebuilt:
        return Path(prebuilt)
    root = source_dir()
    subprocess.run(
        [cargo(), "build", "--release", "--locked", "--lib",
         "--manifest-path", str(root / "Cargo.toml")],
        check=True,
    )
    target = Path(os.environ.get("CARGO_TARGET_DIR", root / "target"))
    if not target.is_absolute():
        target = root / target
    lib = target / "release" / "libkvxfer.so"
    if not lib.is_file():
        raise SystemExit(f"kvxfer: cargo finished but {lib} is missing")
    return lib


class BuildPyWithLibrary(build_py):
    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "kvxfer" / "libkvxfer.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(build_library(), dest)


class PlatformWheel(bdist_wheel):
    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return True


setup(
    version=crate_version(),
    cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel},
    distclass=BinaryDistribution,
)
