"""`call_when_imported`: the callback runs once the module executes, never imports it itself,
and leaves the module's own loader in place."""

from __future__ import annotations

import importlib
import inspect
import sys

from ascend_vlm._compat.post_import import call_when_imported


def test_the_callback_runs_after_the_first_import_only(tmp_path, monkeypatch):
    (tmp_path / "post_import_target.py").write_text("def answer():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "post_import_target", raising=False)
    seen = []
    finders = list(sys.meta_path)
    call_when_imported("post_import_target", lambda module: seen.append(module.answer()))
    assert seen == [] and "post_import_target" not in sys.modules
    module = importlib.import_module("post_import_target")
    importlib.reload(module)
    assert seen == [42]
    assert sys.meta_path == finders
    assert "return 42" in inspect.getsource(module.answer)
    del sys.modules["post_import_target"]


def test_an_imported_module_gets_the_callback_now():
    seen = []
    call_when_imported("inspect", seen.append)
    assert seen == [inspect]
