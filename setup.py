from setuptools import find_packages, setup

setup(
    name="staticpipe",
    version="0.1.0",
    description="Pipeline-parallel training of PaddlePaddle static-graph programs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["staticpipe", "staticpipe.*", "models", "models.*"]),
    python_requires=">=3.9",
    # Paddle itself is an extra: a machine with paddlepaddle-gpu must not be pushed onto the CPU wheel.
    # greenlet: several ranks on one thread (runtime/lanes.py)
    install_requires=["numpy", "tqdm", "matplotlib", "greenlet>=3"],
    extras_require={
        "cpu": ["paddlepaddle==2.6.2", "numpy<2"],  # the default the README installs
        "cpu3": ["paddlepaddle==3.3.1", "numpy>=2"],  # Paddle 3.x, in legacy-IR mode (staticpipe/legacy_ir.py)
        "gpu": ["paddlepaddle-gpu==2.6.2", "numpy<2"],
        "test": ["pytest>=7", "pytest-timeout"],
    },
)
