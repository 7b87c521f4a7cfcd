"""``python -m ascend_vlm.ops --markdown`` prints the README ops table generated from the specs;
``--schemas`` prints each op's torch.library schema; ``--kernel-limits`` the table of the
torch_npu kernels' documented limits (``ops.kernel_constraints``)."""

from __future__ import annotations

import argparse

from ascend_vlm.ops._op_spec import available_specs, markdown_table
from ascend_vlm.ops.kernel_constraints import kernel_limits_markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ascend_vlm.ops", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the README ops table")
    group.add_argument("--schemas", action="store_true", help="print the torch.library schemas")
    group.add_argument(
        "--kernel-limits", action="store_true", help="print the torch_npu kernels' limits table"
    )
    args = parser.parse_args(argv)
    specs = available_specs()
    if args.kernel_limits:
        print(kernel_limits_markdown())
    elif args.markdown:
        print(markdown_table(specs))
    else:
        for spec in specs:
            print(f"{spec.qualname}{spec.schema()}")


if __name__ == "__main__":
    main()
