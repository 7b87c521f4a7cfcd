"""Testing helpers: the mock NPU backend (a strict CPU stand-in for torch_npu) and its pytest
plugin (fixture ``mock_npu``, marker ``mock_npu``)."""

from ascend_vlm.testing.mock_npu import install_mock_npu, mock_npu, uninstall_mock_npu

__all__ = ["install_mock_npu", "mock_npu", "uninstall_mock_npu"]
