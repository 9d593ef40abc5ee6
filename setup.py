from setuptools import find_packages, setup

setup(
    name="elastic-train",
    version="0.1.0",
    description="Elastic data-parallel PyTorch training: workers join and leave while it runs",
    packages=find_packages(include=["elastic", "elastic.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.3", "cloudpickle", "filelock", "xxhash>=3", "pyyaml"],
    extras_require={"report": ["matplotlib"], "test": ["pytest", "pyyaml"],
                    "ray": ["ray>=2.9"], "metrics": ["prometheus_client>=0.20"],
                    "tensorboard": ["tensorboard"]},
    entry_points={"console_scripts": ["elasticrun = elastic.runner.cli:main",
                                    "elasticctl = elastic.ctl.cli:main"]},
)
