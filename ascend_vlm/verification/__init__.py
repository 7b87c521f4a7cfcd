"""Verification: where a model drifts from its reference, module by module and op by op."""
