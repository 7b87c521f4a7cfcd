"""Suite-wide pytest set-up: the mock NPU fixture/marker (ascend_vlm.testing.pytest_plugin)."""

pytest_plugins = ["ascend_vlm.testing.pytest_plugin"]
