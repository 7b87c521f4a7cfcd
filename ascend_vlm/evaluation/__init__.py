"""Held-out evaluation of a VLM (``python -m ascend_vlm eval``) and the measurements it shares
with ``python -m ascend_vlm demo``."""
