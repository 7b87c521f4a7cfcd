"""Build script: setuptools drives CMake to build the ``ascend_vlm._C`` pybind11 extension.

The CMake project decides the backend: the real AscendCL runtime when CANN is installed
(``ASCEND_TOOLKIT_HOME`` / ``ASCEND_HOME_PATH``), the simulated runtime in ``csrc/sim``
otherwise or when ``ASCEND_VLM_FORCE_SIM=1``.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def read_version() -> str:
    """The version from ``ascend_vlm/_version.py``, its one home (CMake reads the same line)."""
    text = (ROOT / "ascend_vlm" / "_version.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    if match is None:
        raise RuntimeError("ascend_vlm/_version.py: expected a line '__version__ = \"...\"'")
    return match.group(1)


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        config = "Debug" if self.debug else "Release"
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={ext_path.parent}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={config}",
        ]
        if os.environ.get("ASCEND_VLM_FORCE_SIM") == "1":
            cmake_args.append("-DASCEND_VLM_FORCE_SIM=ON")
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(["cmake", str(ROOT), *cmake_args], cwd=build_dir, check=True)
        subprocess.run(
            ["cmake", "--build", ".", "--target", "_C", "--parallel", jobs],
            cwd=build_dir,
            check=True,
        )


class BuildPyWithOpSpecs(build_py):
    """Ship ``op_plugins/*/spec.json`` inside the package as ``ascend_vlm/_op_plugins``."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # editable installs read op_plugins/ from the source tree
        target = Path(self.build_lib) / "ascend_vlm" / "_op_plugins"
        for spec in sorted((ROOT / "op_plugins").glob("*/spec.json")):
            (target / spec.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(spec, target / spec.parent.name / "spec.json")


setup(
    name="ascend_vlm",
    version=read_version(),
    description="Fused Ascend NPU kernels, AscendCL runtime bindings and multi-card LoRA "
    "fine-tuning for Hugging Face vision-language models",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    packages=find_packages(include=["ascend_vlm", "ascend_vlm.*"]),
    # The real torch_npu signatures the mock is held to (ascend_vlm.testing.torch_npu_schemas).
    package_data={"ascend_vlm.testing": ["torch_npu_schemas.json"]},
    ext_modules=[CMakeExtension("ascend_vlm._C")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPyWithOpSpecs},
    entry_points={"console_scripts": ["ascend-vlm = ascend_vlm.__main__:main"]},
    install_requires=[
        "torch>=2.6",
        "numpy>=1.24",
        "transformers>=5.17,<6",
        "peft>=0.17",
        "safetensors>=0.4",
        "pillow>=10",
        "tqdm>=4.60",
        "scipy>=1.9",
        "xxhash>=3.0",
    ],
    extras_require={
        "npu": ["torch-npu"],
        "plots": ["matplotlib>=3.7"],
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "prometheus-client>=0.20"],
        "trl": ["trl>=1.0"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"],
    },
    zip_safe=False,
)
