"""Print the paths the CMake build needs, one KEY=VALUE per line (read by CMakeLists.txt)."""
import importlib.util
import os

import torch
import torch.utils.cpp_extension as cpp_extension


def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return ""
    return list(spec.submodule_search_locations)[0]


cutlass = package_dir("cutlass_library")
nvidia = package_dir("nvidia")
cuda_wheel_include = os.path.join(nvidia, "cu13", "include") if nvidia else ""
print("TORCH_VERSION=" + torch.__version__)
print("TORCH_CUDA_VERSION=" + (torch.version.cuda or ""))
print("TORCH_INCLUDE_DIRS=" + "|".join(cpp_extension.include_paths()))
print("TORCH_LIBRARY_DIR=" + os.path.join(os.path.dirname(torch.__file__), "lib"))
print("TORCH_CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))
print("PKG_CUTLASS_DIR=" + (os.path.join(cutlass, "source") if cutlass else ""))
print("CUDA_WHEEL_INCLUDE_DIR=" + (cuda_wheel_include if os.path.isdir(cuda_wheel_include) else ""))
