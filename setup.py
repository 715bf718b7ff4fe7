"""Packaging for pyspark_acs (the product owner fixed setup.py; tool settings live in pyproject.toml)."""

from setuptools import find_packages, setup

setup(
    name="pyspark_acs",
    version="0.1.0",
    description="Fast ACS on open parts: low-latency ordered message delivery through files, for Spark",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["pyspark_acs", "pyspark_acs.*"]),
    package_data={"pyspark_acs.cache.proto": ["*.proto", "*.pyi"], "pyspark_acs.server.copy.proto": ["*.proto", "*.pyi"]},
    install_requires=[
        "pyspark>=4.2,<5",
        "py4j",
        "grpcio>=1.85.1",
        "protobuf>=7.35",
        "pyarrow>=15",
        "numpy>=1.23",  # format/block.py builds message positions with numpy (optional in pyarrow since 16)
        "cachetools>=5",
        # ISA-L's CRC-32, the values of zlib.crc32 at ~20x its speed: every block a producer writes
        # and a reader decodes is checksummed (pyspark_acs/format/checksum.py)
        "isal>=1.6",
        "prometheus-client>=0.20",  # /metrics of the cache server and copy daemon (pyspark_acs/server/metrics.py)
        "rich>=13",  # acs status/copy-status/lag --watch redraw tables in place; progress bars of acs produce (pyspark_acs/cli/watch.py)
    ],
    extras_require={
        # matplotlib: the demo's delay plot (make demo installs .[test]) and tests/integration/test_demo_plot.py
        # cryptography: `acs up --secure` makes a self-signed CA and certificates for a local deployment.
        # moto[server]: a real S3 endpoint on loopback for the tiered-storage tests (tests/storage/test_tiered.py).
        # pytest<9.2: pytest 9.2 keeps node ids structured, and pytest-xdist's --dist loadgroup
        # (3.8) still appends its group to the old field, so nothing is grouped: each worker
        # then starts every module's servers and a Spark session of its own (reported at
        # github.com/pytest-dev/pytest-xdist/issues/1386). tests/conftest.py refuses to run a parallel suite that is not grouped.
        "secure": ["cryptography>=42"],
        "test": ["pytest>=8,<9.2", "pytest-timeout", "pytest-xdist>=3.6", "chispa", "hypothesis", "grpcio-tools>=1.85.1", "pandas<3",
                 "matplotlib", "cryptography>=42", "moto[server]"],
        # hiredis: redis-py's C reply parser, as Redis users run it (the fan-out peer is not handicapped).
        "bench": ["redis[hiredis]", "matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "acs=pyspark_acs.cli.main:main",
            "acs-cache-server=pyspark_acs.server.cache.server:main",
            "acs-copy-daemon=pyspark_acs.server.copy.daemon:main",
            "acs-tier-mover=pyspark_acs.server.tier.daemon:main",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
    ],
)
