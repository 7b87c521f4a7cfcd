"""Run ``ascend_vlm.patch(model, strict=False)`` (the generic path) over every image-text-to-text
model type transformers ships and write the table into docs/generic_path.md.

    python scripts/generic_path_table.py                    # rewrite the table (every type)
    python scripts/generic_path_table.py --check            # exit 1 if the table is stale
    python scripts/generic_path_table.py --types llava,fuyu --check   # those rows only

Each type runs in its own forked subprocess with a timeout, so one type that hangs or crashes
costs its row only. There it is built tiny from its default config (`shrink`: a few layers,
two heads of the stock head size, narrow widths, few experts; `shrink_vocabulary`), in fp32
with eager attention, and run on random text tokens, with one random image where the model's
``get_image_features`` takes a plain ``pixel_values`` of its vision config's size (and as many
image tokens as it makes). Then: ``patch(strict=False)``, the logits compared with stock
(parity: max abs difference <= ``ATOL``), ``unpatch`` and the logits compared bit for bit. "fused attention"
counts the attention modules routed and says whether our attention function ran.

The table sits between ``<!-- BEGIN GENERATED: generic-path -->`` and ``<!-- END GENERATED:
generic-path -->``; its rows are the types, sorted, and a summary line precedes it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

DOC = Path(__file__).resolve().parents[1] / "docs" / "generic_path.md"
BEGIN, END = "<!-- BEGIN GENERATED: generic-path -->", "<!-- END GENERATED: generic-path -->"
ATOL = 1e-4
TIMEOUT_SECONDS = 240
SEQUENCE = 12
# Width attributes, layer counts and expert counts the shrinker rewrites (when an int).
HEAD_ATTRIBUTES = ("num_attention_heads", "num_heads", "n_heads", "encoder_attention_heads")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads")
HIDDEN_ATTRIBUTES = ("hidden_size", "embed_dim", "d_model", "hidden_dim")
INTERMEDIATE_ATTRIBUTES = ("intermediate_size", "ffn_dim", "mlp_dim", "encoder_ffn_dim")
LAYER_ATTRIBUTES = ("num_hidden_layers", "num_layers", "depth", "encoder_layers", "n_layers")
EXPERT_ATTRIBUTES = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4}
TOP_K_ATTRIBUTES = {"num_experts_per_tok": 2, "moe_topk": 2}
MOE_WIDTH_ATTRIBUTES = ("moe_intermediate_size", "shared_expert_intermediate_size")
LAYERS, HEADS, VOCAB = 2, 2, 512
# Images whose tower would see more patches than this are not made (text only).
MAX_PATCHES = 1024


# --------------------------------------------------------------------------- one type


def _configs(config, prefix: str = ""):
    """(dotted path, config) of `config` and every sub-config in it, depth first."""
    from transformers import PreTrainedConfig

    yield prefix, config
    for name in getattr(type(config), "sub_configs", {}):
        sub_config = config.__dict__.get(name)
        if isinstance(sub_config, PreTrainedConfig):
            yield from _configs(sub_config, f"{prefix}{name}.")


def _set_int(config, names, value) -> None:
    for name in names:
        if isinstance(config.__dict__.get(name), int) and not isinstance(
            config.__dict__[name], bool
        ):
            config.__dict__[name] = min(config.__dict__[name], value)


def shrink(config) -> None:
    """Make `config` (and each sub-config) tiny in place: ``LAYERS`` layers (or one per distinct
    ``layer_types`` entry), ``HEADS`` heads of the stock head size (so RoPE sections keep
    fitting), hidden = heads * head size, MLP twice that, at most 4 experts with top-2."""
    for _, sub in _configs(config):
        values = sub.__dict__
        heads = next((values[n] for n in HEAD_ATTRIBUTES if isinstance(values.get(n), int)), None)
        hidden = next(
            (values[n] for n in HIDDEN_ATTRIBUTES if isinstance(values.get(n), int)), None
        )
        head_dim = values.get("head_dim")
        if not isinstance(head_dim, int) and heads and hidden:
            head_dim = hidden // heads
        if heads and head_dim:
            kv_heads = next(
                (values[n] for n in KV_HEAD_ATTRIBUTES if isinstance(values.get(n), int)), heads
            )
            new_heads = min(heads, HEADS)
            _set_int(sub, HEAD_ATTRIBUTES, new_heads)
            _set_int(sub, KV_HEAD_ATTRIBUTES, 1 if kv_heads < heads else new_heads)
            width = new_heads * head_dim
            _set_int(sub, HIDDEN_ATTRIBUTES, width)
            _set_int(sub, INTERMEDIATE_ATTRIBUTES, 2 * width)
            _set_int(sub, MOE_WIDTH_ATTRIBUTES, width)
        _set_int(sub, LAYER_ATTRIBUTES, LAYERS)
        for name, value in {**EXPERT_ATTRIBUTES, **TOP_K_ATTRIBUTES}.items():
            _set_int(sub, (name,), value)
        if "head_dim" in values and values["head_dim"] is None and heads and head_dim:
            values["head_dim"] = head_dim
        layers = next((values[n] for n in LAYER_ATTRIBUTES if isinstance(values.get(n), int)), None)
        if layers and isinstance(values.get("layer_types"), list):
            # One layer of each type (linear and full attention, sliding and global) at least.
            kinds = list(dict.fromkeys(values["layer_types"]))
            values["layer_types"] = (kinds * LAYERS)[: max(LAYERS, len(kinds))]
            for name in LAYER_ATTRIBUTES:
                if isinstance(values.get(name), int):
                    values[name] = len(values["layer_types"])
            layers = len(values["layer_types"])
        if layers and isinstance(values.get("mlp_only_layers"), list):
            values["mlp_only_layers"] = [i for i in values["mlp_only_layers"] if i < layers]
    text = getattr(config, "text_config", None)
    for _, sub in _configs(config):
        if isinstance(sub.__dict__.get("projection_dim"), int) and sub is not text and text:
            sub.__dict__["projection_dim"] = text.hidden_size  # projects into the shrunk decoder


def _special_id_names(config):
    """(config, attribute) of every token id a config names (``*_token_id`` / ``*_token_index``,
    an int or a list of ints)."""
    for _, sub in _configs(config):
        for name, value in list(sub.__dict__.items()):
            if re.search(r"token_(id|index|ids)$", name) and isinstance(value, int | list | tuple):
                yield sub, name


def shrink_vocabulary(config) -> None:
    """``VOCAB`` tokens in every config with a ``vocab_size``; a special token id at or past it
    moves to the top of the new vocabulary (the same new id wherever the old one appears)."""
    moved: dict[int, int] = {}

    def new_id(value: object) -> object:
        if not isinstance(value, int) or isinstance(value, bool) or value < VOCAB:
            return value
        return moved.setdefault(value, VOCAB - 1 - len(moved))

    for sub, name in _special_id_names(config):
        value = sub.__dict__[name]
        sub.__dict__[name] = (
            type(value)(new_id(v) for v in value)
            if isinstance(value, list | tuple)
            else new_id(value)
        )
    _set_int_all(config, ("vocab_size",), VOCAB)


def _set_int_all(config, names, value) -> None:
    for _, sub in _configs(config):
        _set_int(sub, names, value)


def _special_ids(config) -> set[int]:
    """Every token id the configs name."""
    ids: set[int] = set()
    for sub, name in _special_id_names(config):
        value = sub.__dict__[name]
        ids |= {
            v for v in (value if isinstance(value, list | tuple) else [value]) if isinstance(v, int)
        }
    return ids


def _text_inputs(config):
    import torch

    vocab = min(
        (
            sub.vocab_size
            for _, sub in _configs(config)
            if isinstance(getattr(sub, "vocab_size", None), int)
        ),
        default=1000,
    )
    allowed = [i for i in range(3, min(vocab, 400)) if i not in _special_ids(config)]
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(len(allowed), (1, SEQUENCE), generator=generator)
    input_ids = torch.tensor(allowed)[picks]
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _feature_rows(features) -> int:
    """How many image tokens `get_image_features` made: rows of its (pooled) output."""
    import torch

    features = getattr(features, "pooler_output", features)
    if isinstance(features, torch.Tensor):
        return features.numel() // features.shape[-1]
    return sum(_feature_rows(f) for f in features)


def _image_inputs(model, text: dict) -> dict | None:
    """`text` with one random square image of the vision config's size and as many image tokens
    (after the third text token) as ``get_image_features`` makes of it; None when the model
    has no such method, image size or image token, or it raises."""
    import torch

    config = model.config
    vision = getattr(config, "vision_config", None)
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    token = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
    features = getattr(getattr(model, "model", model), "get_image_features", None)
    if not (isinstance(size, int) and isinstance(patch, int) and isinstance(token, int)):
        return None
    if features is None or (size // patch) ** 2 > MAX_PATCHES:
        return None
    channels = getattr(vision, "num_channels", 3)
    generator = torch.Generator().manual_seed(1)
    image = torch.randn(1, channels, size, size, generator=generator)
    for pixel_values in (image, image[None]):  # [images, C, H, W], else [batch, images, ...]
        try:
            with torch.no_grad():
                count = _feature_rows(features(pixel_values=pixel_values))
            break
        except Exception:  # a tower wanting other inputs (grids, sizes, masks): text only
            continue
    else:
        return None
    ids = text["input_ids"]
    input_ids = torch.cat((ids[:, :3], torch.full((1, count), token), ids[:, 3:]), dim=1)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
    }


def _logits(model, inputs):
    import torch

    with torch.no_grad():
        output = model(**inputs)
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output[0]


def run_one(model_type: str) -> dict:
    """The table row of `model_type` (see the module docstring)."""
    import torch
    from transformers import AttentionInterface, AutoConfig, AutoModelForImageTextToText

    import ascend_vlm
    from ascend_vlm.models import spec_for
    from ascend_vlm.patching import ATTENTION_NAME, ascend_attention_forward

    row = {"type": model_type}
    try:
        config = AutoConfig.for_model(model_type)
        shrink(config)
        shrink_vocabulary(config)
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(
            config, attn_implementation="eager", dtype=torch.float32
        ).eval()
        inputs = _text_inputs(model.config)
        stock = _logits(model, inputs)
    except Exception as error:  # any failure to build or run stock is this row's result
        row["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:160]
        return row
    with_image = _image_inputs(model, inputs)
    try:
        if with_image is not None:
            stock, inputs = _logits(model, with_image), with_image
    except Exception:  # the image inputs guessed wrong: text only
        with_image = None
    row["image"] = with_image is not None
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return ascend_attention_forward(*args, **kwargs)

    row["path"] = "family" if spec_for(model.config) is not None else "generic"
    report = ascend_vlm.patch(model, strict=False)
    AttentionInterface.register(ATTENTION_NAME, counting)
    row["attention"] = report.swapped_count("attention-text") + report.swapped_count(
        "attention-vision"
    )
    row["verified"] = sum(count for *_, count in report.probe_verified())
    row["refused"] = sum(
        count for (kind, _, why), count in report.left_alone.items() if why.startswith("probe:")
    )
    try:
        patched = _logits(model, inputs)
        row["diff"] = float((patched - stock).abs().max())
    except Exception as error:
        row["patched_error"] = f"{type(error).__name__}: {error}".splitlines()[0][:160]
    row["attention_ran"] = calls[0] > 0
    ascend_vlm.unpatch(model)
    row["unpatch_exact"] = bool(torch.equal(_logits(model, inputs), stock))
    return row


# --------------------------------------------------------------------------- the table


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _run_into(connection, model_type: str) -> None:
    """`run_one` for the child process: its row (or its exception) goes down `connection`."""
    try:
        row = run_one(model_type)
    except BaseException as error:
        row = {"type": model_type, "error": f"crashed: {type(error).__name__}: {error}"[:200]}
    connection.send(row)
    connection.close()


def run_isolated(model_type: str) -> dict:
    """`run_one` in a forked child (torch, transformers and ascend_vlm imported once, in the
    parent), stopped after ``TIMEOUT_SECONDS``."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_run_into, args=(sender, model_type), daemon=True)
    child.start()
    sender.close()
    if not receiver.poll(TIMEOUT_SECONDS):
        child.kill()
        child.join()
        return {"type": model_type, "error": f"timed out after {TIMEOUT_SECONDS} s"}
    try:
        row = receiver.recv()
    except EOFError:
        row = {"type": model_type, "error": "crashed: the child died without a row"}
    child.join()
    return row


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_row(row: dict) -> str:
    """One markdown row: type, built, path, fused attention, probe-verified swaps, parity,
    unpatch."""
    if "error" in row:
        return f"| {row['type']} | no: {_cell(row['error'])} | | | | | | |"
    attention = (
        f"yes ({row['attention']} modules)" if row["attention"] and row["attention_ran"] else "no"
    )
    verified = f"{row['verified']}" + (f" ({row['refused']} refused)" if row["refused"] else "")
    if "patched_error" in row:
        parity = f"no: {_cell(row['patched_error'])}"
    else:
        parity = f"{'yes' if row['diff'] <= ATOL else 'no'} ({row['diff']:.0e})"
    exact = "yes" if row["unpatch_exact"] else "no"
    image = "text + image" if row["image"] else "text"
    cells = (row["type"], "yes", row["path"], image, attention, verified, parity, exact)
    return f"| {' | '.join(cells)} |"


def _counts(rows: list[dict]) -> tuple[int, int, int]:
    built = [r for r in rows if "error" not in r]
    fused = [r for r in built if r["attention"] and r["attention_ran"]]
    both = [r for r in fused if "patched_error" not in r and r["diff"] <= ATOL]
    return len(built), len(fused), len(both)


def render(rows: list[dict]) -> str:
    """The generated block: a summary line and the table."""
    built, fused, both = _counts(rows)
    lines = [
        f"{len(rows)} image-text-to-text model types; {built} built tiny; {fused} with fused "
        f"attention; {both} with fused attention and parity (max abs logit difference <= {ATOL:g}).",
        "",
        "| model type | built | path | inputs | fused attention | probe-verified swaps | "
        "parity with stock | unpatch bit-exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [render_row(row) for row in sorted(rows, key=lambda r: r["type"])]
    return "\n".join(lines)


def _table_rows(text: str) -> dict[str, str]:
    """Model type -> rendered row, of the table in `text`'s generated block."""
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and "---" not in line]
    return {line.split("|")[1].strip(): line for line in rows[1:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the table is stale")
    parser.add_argument("--types", help="comma-separated model types (default: every one)")
    args = parser.parse_args()
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401 - what every modeling module imports
    from tqdm import tqdm

    import ascend_vlm  # noqa: F401 - imported once, before the children fork

    torch.set_num_threads(1)

    types = args.types.split(",") if args.types else model_types()
    rows = []
    for model_type in (progress := tqdm(types, unit="type")):
        progress.set_postfix_str(model_type)
        rows.append(run_isolated(model_type))
    current = DOC.read_text(encoding="utf-8")
    before, rest = current.split(BEGIN, 1)
    block, after = rest.split(END, 1)
    if args.check:
        expected = _table_rows(current)
        stale = [r["type"] for r in rows if expected.get(r["type"]) != render_row(r)]
        if not args.types and block != f"\n{render(rows)}\n":
            stale.append("the summary or the set of types")
        if stale:
            print(f"{DOC.name} is stale ({', '.join(stale)}): run {__file__}", file=sys.stderr)
            return 1
        return 0
    if args.types:
        raise SystemExit("--types: only with --check (the table is written from every type)")
    DOC.write_text(f"{before}{BEGIN}\n{render(rows)}\n{END}{after}", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
