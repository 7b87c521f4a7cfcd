"""Suite-wide pytest set-up: the mock NPU fixture/marker (ascend_vlm.testing.pytest_plugin),
the small VLMs with processors (chat_vlms.py), the tiny default model's checkpoint and
processor, the command-line error check shared by the `python -m ascend_vlm` command tests,
a loopback HTTP server for image URLs, and the loader of `scripts/` modules."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest_plugins = ["ascend_vlm.testing.pytest_plugin", "chat_vlms"]


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The embedded default model's checkpoint folder (random weights), built on first use."""
    from ascend_vlm.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def processor(tiny_model_path: Path):
    """The default model's processor."""
    from ascend_vlm.default_model import load_processor

    return load_processor(tiny_model_path)


@pytest.fixture
def command_error(capsys) -> Callable[[list[str]], str]:
    """``command_error(argv)`` runs ``python -m ascend_vlm`` with ``argv``, asserts argparse's
    rejection (exit status 2, nothing on stdout, the sub-command's usage line first on stderr)
    and returns stderr's last line, the ``error:`` line."""
    from ascend_vlm.__main__ import main

    def run(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert lines[0].startswith(f"usage: python -m ascend_vlm {argv[0]} ")
        return lines[-1]

    return run


@pytest.fixture(scope="module")
def loopback_http(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """``(folder, base URL)``: a loopback HTTP server (``http://127.0.0.1:PORT``) over an empty
    folder the test fills, for the module's tests."""
    folder = tmp_path_factory.mktemp("served")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join()


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="session")
def script_module() -> Callable[[str], ModuleType]:
    """``script_module(name)`` imports ``scripts/<name>.py`` (scripts are not a package)."""

    # Scripts import their shared helpers (scripts/_bench_models.py) as top-level modules, as
    # they do when run from the command line.
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    """A default gloo process group of this process alone, for the test's duration."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
