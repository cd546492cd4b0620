import os
import sys

from setuptools import find_packages, setup


def _warn(msg):
    print(f"WARNING: horovod_adtopk: {msg}; the package will use its pure-PyTorch selection kernels", file=sys.stderr)


def native_extension():
    """Build options for the optional native CPU kernels ``horovod_adtopk._C``.

    Empty when torch is not importable at build time or ``HOROVOD_ADTOPK_NATIVE_BUILD=0``; a failing
    compilation only prints a warning. ``HOROVOD_ADTOPK_NATIVE_ARCH`` adds architecture flags, e.g.
    ``native`` (-march=native) or ``-march=x86-64-v3``.
    """
    if os.environ.get("HOROVOD_ADTOPK_NATIVE_BUILD", "1") == "0":
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as exc:  # torch missing at build time (e.g. build isolation)
        _warn(f"torch is not importable at build time ({exc}); not building the native kernels")
        return {}

    compile_args = ["-O3"]
    link_args = []
    if sys.platform.startswith("linux"):  # at::parallel_for is OpenMP-based in Linux torch builds
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    arch = os.environ.get("HOROVOD_ADTOPK_NATIVE_ARCH", "").strip()
    if arch:
        compile_args += arch.split() if arch.startswith("-") else [f"-march={arch}"]

    class OptionalBuildExtension(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as exc:
                _warn(f"building the native kernels failed ({exc})")

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                _warn(f"building {ext.name} failed ({exc})")

    ext = CppExtension(
        "horovod_adtopk._C",
        ["horovod_adtopk/csrc/kernels.cpp"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(
    name="horovod_adtopk",
    version="0.1.0",
    description="All-dimension top-k (ADTopk) gradient compression for Horovod + PyTorch",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["horovod_adtopk", "horovod_adtopk.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy", "horovod==0.28.1"],
    extras_require={"train": ["tqdm", "matplotlib", "mpi4py"], "test": ["pytest", "hypothesis"],
                    # the versions examples/frameworks/ and tests/test_integrations.py were checked with
                    "integrations": ["pytorch-lightning==2.6.6", "accelerate==1.15.0", "transformers==5.23.0",
                                     "ray[train]==2.60.0"]},
    license="Apache-2.0",
    **native_extension(),
)
