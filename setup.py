from setuptools import find_packages, setup

setup(
    name="horovod_adtopk",
    version="0.1.0",
    description="All-dimension top-k (ADTopk) gradient compression for Horovod + PyTorch",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["horovod_adtopk", "horovod_adtopk.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy", "horovod==0.28.1"],
    extras_require={"train": ["tqdm", "matplotlib", "mpi4py"], "test": ["pytest", "hypothesis"]},
    license="Apache-2.0",
)
