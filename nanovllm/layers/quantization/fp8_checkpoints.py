"""Which FP8 checkpoints the FP8 method reads: each config.json quantization_config is checked here, and
anything else is refused by name (a ValueError saying what is supported)."""
import re

BLOCK = 128         # the block scheme's weight blocks are BLOCK x BLOCK, its activation groups 1 x BLOCK
# quantization_config["quant_method"] -> what is supported of it
FORMATS = {"fp8": "fp8 (e4m3, weight_block_size [128, 128], dynamic activations)",
           "compressed-tensors": "compressed-tensors FP8-dynamic (per-channel weights, per-token dynamic "
                                 "activations)"}
# the decoder's linear layers as checkpoints name them (Llama, Qwen2, Qwen3): what ignore lists are checked against
CHECKPOINT_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def checked_block_fp8(config: dict, hf_config, where: str) -> None:
    """Qwen's and DeepSeek's FP8 releases (quant_method "fp8"): e4m3, dynamic activations, 128x128 blocks."""
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 format {fmt!r} in {where} is not supported; supported: e4m3")
    activations = config.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise ValueError(f"fp8 activation_scheme {activations!r} (static activation scales) in {where} is not "
                         f"supported; supported: dynamic")
    block = config.get("weight_block_size")
    if block is None:
        raise ValueError(f"fp8 without weight_block_size (one scale per tensor) in {where} is not supported; "
                         f"supported: weight_block_size [128, 128]")
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"fp8 weight_block_size {list(block)} in {where} is not supported; supported: [128, 128]")
    check_exemptions((config.get("modules_to_not_convert") or []) + (config.get("ignored_layers") or []),
                     hf_config, where)


def checked_fp8_dynamic(config: dict, hf_config, where: str) -> None:
    """compressed-tensors: one config group, FP8 weights per channel and FP8 activations per token, dynamic."""
    def refuse(what: str):
        raise ValueError(f"compressed-tensors {what} in {where} is not supported; supported: FP8-dynamic (weights "
                         f"num_bits 8, type float, strategy channel, symmetric; input_activations num_bits 8, type "
                         f"float, strategy token, dynamic)")
    if config.get("format", "float-quantized") != "float-quantized":
        refuse(f"format {config.get('format')!r}")
    if config.get("kv_cache_scheme"):
        refuse("kv_cache_scheme (use kv_cache_dtype='fp8' for an fp8 KV cache)")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        refuse(f"with {len(groups)} config groups")
    group = next(iter(groups.values()))
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    if set(group.get("targets") or []) != {"Linear"}:
        refuse(f"targets {group.get('targets')!r}")
    if group.get("output_activations"):
        refuse("output_activations")
    for name, scheme, strategy, dynamic in (("weights", weights, "channel", False),
                                            ("input_activations", inputs, "token", True)):
        wanted = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=dynamic)
        found = {key: scheme.get(key, True if key == "symmetric" else None) for key in wanted}
        if found["dynamic"] is None and not dynamic:
            found["dynamic"] = False
        if found != wanted or scheme.get("group_size") or scheme.get("block_structure"):
            refuse(f"{name} {found}")
    check_exemptions(config.get("ignore") or [], hf_config, where)


def check_exemptions(entries: list[str], hf_config, where: str) -> None:
    """Layers a checkpoint leaves unquantized: the embeddings and the LM head (never quantized here) are fine;
    an attention or MLP projection is refused (every one of them is quantized here). Entries are module names
    ("lm_head"), name fragments, or compressed-tensors' "re:" regular expressions."""
    for entry in entries:
        pattern = entry[3:] if entry.startswith("re:") else None
        for i in range(hf_config.num_hidden_layers):
            for linear in CHECKPOINT_LINEARS:
                name = f"model.layers.{i}.{linear}"
                if (re.match(pattern, name) if pattern is not None else entry == name or name.endswith(f".{entry}")
                        or f".{entry}." in f".{name}."):
                    raise ValueError(f"{where}'s quantization_config leaves {name} unquantized ({entry!r}); "
                                     f"per-layer exceptions are not supported (only the embeddings and the LM "
                                     f"head stay unquantized)")
