"""Builds cake_ops: setuptools packages python/cake_ops and CMake builds its _C extension.

Environment: CAKE_CUDA_ARCHS (default 9.0a), CAKE_WITH_CUDA (AUTO/ON/OFF), CUTLASS_DIR,
CUDA_HOME, MAX_JOBS (parallel compile jobs), CAKE_BUILD_TYPE (Release/Debug/RelWithDebInfo).
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_type = os.environ.get("CAKE_BUILD_TYPE", "Release")
        build_dir = ROOT / "build" / f"setup-{build_type.lower()}"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DCAKE_CUDA_ARCHS={os.environ.get('CAKE_CUDA_ARCHS', '9.0a')}",
            f"-DCAKE_WITH_CUDA={os.environ.get('CAKE_WITH_CUDA', 'AUTO')}",
        ]
        if os.environ.get("CUTLASS_DIR"):
            configure.append(f"-DCUTLASS_DIR={os.environ['CUTLASS_DIR']}")
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs], check=True)


setup(
    packages=["cake_ops"],
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("cake_ops._C")],
    cmdclass={"build_ext": CMakeBuild},
)
